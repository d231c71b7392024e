"""`python -m vlora ...`: the same commands as the `vlora` script."""

from .cli import main

if __name__ == "__main__":
    main()
