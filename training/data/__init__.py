"""Training data: the tasks, their labelers and samplers, text corpora, tokenizer training and batches."""
