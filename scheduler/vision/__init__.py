"""Images on the scheduler's side (torch-free): loading them under the media policy, the model's image processor
(numpy + Pillow), and the placeholder tokens that mark where each image's embeddings go in the prompt."""
