"""The engine: the model, the training loop and beam search. It never imports typer or rich."""
