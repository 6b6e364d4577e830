"""Training objectives and the loop: losses, distillation, optimisation and checkpoints."""
