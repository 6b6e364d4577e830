"""RegularGPT: sliding-dilated attention with weight-shared layers, its cache, decode and costs."""
