"""The synchronous RL trainer: `python -m jaxrl.train [--config FILE] [--run-dir DIR] [key=value ...]`."""
