"""Entry points of the `vlora` command: each module has a plain `run(cfg)`."""
