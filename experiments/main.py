r"""The main job: runs one experiment config and writes results, report and plots.

    python -m experiments.main --config=configs/default.py --workdir=runs/default
    python -m experiments.main --config=configs/default.py:smoke --workdir=/tmp/smoke
    python -m experiments.main --config=configs/toy.py --workdir=runs/toy \
        --config.model.num_layers=4

`--config=FILE[:ARG]` loads `get_config(ARG)` of FILE (ml_collections; the
config is locked, so an override of an unknown key fails), and the runner
loads `get_sweep(ARG)` of the same file with the same ARG. The workdir gets
results.jsonl (append-only), results.csv, report.md (its plots embedded),
PNG plots, log.txt (the libraries' log records) and, for families that train,
the trained params; rerunning the same command skips finished points. The
terminal shows a progress bar and a short summary (`--verbosity=1` adds the
log records). See experiments/framework/runner.py.

`--import=MODULE_OR_FILE` (repeatable) imports a module of your own first -- a dotted
name importable from the current directory, or a .py file -- so a cache kind or eviction
policy it registers is a valid `--config.cache.kind` (docs/DESIGN.md,
"Recipes"); `configs/default.py:kind` runs one point of any kind:

    python -m experiments.main --config=configs/default.py:kind --workdir=runs/mine \
        --import=my_policy.py --config.cache.kind=my-policy

On a multi-host slice (docs/sharding.md) every host runs the same command with
`--distributed`, which calls `jax.distributed.initialize()` before anything
else (its arguments are detected on Cloud TPU, SLURM and Open MPI; elsewhere
pass `--coordinator_address=host0:1234 --num_processes=N --process_id=i`) and
a config whose `mesh.shape` spans every host's devices.

One run at a time holds a workdir (and its training directory): a second
run stops at once with exit status 2, or with `--wait` waits for the first
(experiments/framework/workdir.py). Mistakes on the command line -- an unknown flag or
config key, a value of the wrong type, a missing config file, an invalid
config, a busy workdir -- print one `error: ...` line and exit with status 2
(`--verbosity=1` adds the traceback; experiments/framework/cli.py).
"""

from absl import flags
from ml_collections import config_flags

from experiments.framework import cli

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/default.py or configs/default.py:smoke.",
    lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for results, report, plots and trained params.")
flags.DEFINE_bool("wait", False, "If another run holds the workdir or its training directory, "
                  "wait for it to finish instead of stopping with an error.")
flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() before anything else "
                  "(one process per host of a multi-host slice; docs/sharding.md).")
flags.DEFINE_string("coordinator_address", None, "With --distributed: host:port of process 0 "
                    "(None: detected on Cloud TPU, SLURM, Open MPI).")
flags.DEFINE_integer("num_processes", None, "With --distributed: number of processes (None: "
                     "detected).")
flags.DEFINE_integer("process_id", None, "With --distributed: this process's id in [0, "
                     "num_processes) (None: detected).")
cli.define_import_flag()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  """Runs (or resumes) the experiment of `--config` in `--workdir` (`runner.main`)."""
  if len(argv) > 1:
    raise cli.UserError(f"unexpected arguments: {' '.join(argv[1:])} (flags are --name=value)")
  if FLAGS.distributed:  # before any JAX call (loading the config touches no backend)
    import jax  # pylint: disable=g-import-not-at-top
    # CPU devices of several processes need a collectives backend (GPU / TPU bring their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  cli.import_modules(FLAGS[cli.IMPORT_FLAG].value)  # before the config is validated
  # Imported here so that a mistake on the command line is reported before JAX loads.
  from experiments.framework import runner  # pylint: disable=g-import-not-at-top
  runner.main(FLAGS.config, FLAGS.workdir, config_flags.get_config_filename(FLAGS["config"]),
              wait=FLAGS.wait)


if __name__ == "__main__":
  cli.run(main)
