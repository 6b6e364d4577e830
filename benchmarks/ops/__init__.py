"""Ops alone: the linear scan, Sliding-Dilated-Attention, the decode products and the sampler."""
