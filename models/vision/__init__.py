"""Vision towers of the vision-language families: pixels -> embedding rows in the language model's space."""
