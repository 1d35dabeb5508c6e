"""The engine: model, trainer, decoder. It never imports typer or rich."""
