"""One exception type for bad input, so every command can end with one clear line and exit 2."""


class DSV3Error(Exception):
    """A problem with the user's input (config, checkpoint, flag, file) that we can name in one line."""
