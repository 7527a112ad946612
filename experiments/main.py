r"""The main job: runs one experiment config and writes results, report and plots.

    python -m experiments.main --config=configs/default.py --workdir=runs/default
    python -m experiments.main --config=configs/default.py:smoke --workdir=/tmp/smoke \
        --config.model.num_layers=2

`--config=FILE[:ARG]` loads `get_config(ARG)` of FILE (ml_collections; the
config is locked, so an override of an unknown key fails), and the runner
loads `get_sweep(ARG)` of the same file with the same ARG. The workdir gets
results.jsonl (append-only), results.csv, report.md, PNG plots and the
trained params; rerunning the same command skips finished points. See
experiments/runner.py.
"""

from absl import app, flags
from ml_collections import config_flags

from experiments import runner

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/default.py or configs/default.py:smoke.",
    lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for results, report, plots and trained params.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  """Runs (or resumes) the experiment of `--config` in `--workdir` (`runner.main`)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  runner.main(FLAGS.config, FLAGS.workdir, config_flags.get_config_filename(FLAGS["config"]))


if __name__ == "__main__":
  app.run(main)
