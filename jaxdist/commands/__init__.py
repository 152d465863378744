"""The `jaxdist` command's verbs, one module each, named by the verb with '-' and ' ' as '_':
`jaxdist train` is train.py, `jaxdist config show` config_show.py, `jaxdist build-kernels`
build_kernels.py. What several verbs' arguments share is in arguments.py.

Each verb's module holds:

- `HELP`: its line in `jaxdist --help`;
- `add_arguments(parser)`: its arguments and options;
- `run(args)`: runs it on the parsed arguments; returns its exit code (None: 0);

and, where they apply: `LOCAL_PATHS`, its (argument, name on the command line) pairs that name files
or folders, refused before it starts where they name object storage; `OFFLINE = True` where it runs
nothing on this process's devices, so that it does not join the run's other processes; and
`settings(args)`, the process-wide settings it makes before JAX starts (`plan --devices`).

A verb's module imports only the standard library and jaxdist modules that import no JAX at its top,
and what it runs inside `run`: so `jaxdist --help` and a usage error import no JAX, and a Ctrl-C
while a verb imports JAX is the command's one-line exit 130. The libraries the verbs run live in
their layers: the training loop in `jaxdist.loop`, what bench, plan, doctor and scale measure or
compute in `jaxdist.observe`, the preparing of data in `jaxdist.data`, the exports in
`jaxdist.checkpoint`, the kernel builder in `jaxdist.kernels`."""
