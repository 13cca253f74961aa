"""Images on the scheduler side (torch-free): the media policy, the model's image processor, placeholder tokens."""
