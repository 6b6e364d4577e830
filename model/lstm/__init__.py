"""The LSTM baseline."""
