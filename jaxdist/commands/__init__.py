"""The commands that measure and plan, apart from a run: `jaxdist bench` (bench.py, with what a save
costs: checkpoint_cost.py, and the GPUs' clocks: clocks.py), `plan` (plan.py), `doctor`
(doctor.py), `scale` (scale.py), `plot` (plot.py), and the compiled HLO's collectives they read
(hlo.py). What a run uses to observe itself is in `jaxdist.observe`."""
