"""The exceptions the CLI turns into one line on stderr and an exit code.

`UserError` (exit code 2, before any compile): a mistake in the input; messages name the config
key, the value and the fix. `NonFiniteError` (exit code 3): training stopped at a non-finite step,
with nothing of that step saved.
"""


class UserError(Exception):
    """A mistake in the user's input (config, data, command line); not a bug in jaxdist."""


class NonFiniteError(Exception):
    """A step's loss or gradients were not finite and `train.on_nonfinite` says to stop; the message
    names the step and the last checkpoint, which holds only finite steps."""
