"""Faults of a live server: huge inputs, a stalled engine, oversized bodies, bursts."""
