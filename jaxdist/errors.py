"""The one exception type for a user's mistake.

Anything raised as `UserError` is printed by the CLI as a single line on stderr and exits with
code 2, before any compile. Messages name the config key, the value and the fix.
"""


class UserError(Exception):
    """A mistake in the user's input (config, data, command line); not a bug in jaxdist."""
