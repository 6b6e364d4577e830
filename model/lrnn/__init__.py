"""The block-diagonal input-dependent linear RNN and its diagonal baseline."""
