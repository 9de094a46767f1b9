"""Command-line interface: ``matrix-owner-optim {plan,train,bench,simulate}``."""
