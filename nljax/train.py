"""Train a model:  python -m nljax.train [--config FILE] [--cpu-devices N] [--quiet] [--resume | --resume=auto] [--print-config] [key=value ...]"""

from __future__ import annotations

import dataclasses
import sys

from nljax import cli
from nljax.run import autoresume
from nljax.run.resuming import launch_mesh, resuming, step_resume
from nljax.run.trainer import is_main, resume_step_guess, train


def _configure(args, cfg):
    """The flags as the settings they stand for; a resume of this run starts from its saved
    config.yaml, with `--config` and the overrides on top (nljax/run/resuming.py)."""
    if args.quiet:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, quiet=True))
    if args.resume and not cfg.checkpoint.resume:
        cfg = resuming(cfg, "latest")
    return step_resume(cfg, args.config, args.overrides)


def _settle(args, cfg):
    """`--resume=auto`, once the processes joined: resume the run in run.dir, start it, or start
    it over, as process 0 decides from what is there (nljax/run/autoresume.py); one line on
    process 0's standard error says which when it does not resume."""
    if not args.resume_auto:
        return cfg
    loud = is_main() and not cfg.run.quiet and not args.print_config
    say = (lambda line: print(line, file=sys.stderr)) if loud else (lambda line: None)
    return autoresume.configured(cfg, args.config, args.overrides, say, live_refused=not args.print_config)


def _run(args, cfg) -> int:
    # the devices are known once the processes joined: a resumed run's saved mesh may not fit them
    train(launch_mesh(cfg, args.config, args.overrides))
    return 0


def main(argv=None) -> int:
    p = cli.parser("nljax.train", "Train a nested-learning model on every available device.")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint (checkpoint.resume=latest)")
    # an option string of its own: `--resume` with an optional value would take the next override for it
    resume.add_argument("--resume=auto", dest="resume_auto", action="store_true",
                        help="continue from the latest checkpoint if run.dir has one, else start the run (over, in "
                        "place, if it saved none): one command for a job's first start and its restarts")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML, each key with its comment, and exit (nothing is built; "
                   "a config that cannot train as it is is printed too, with a note saying what it lacks)")
    return cli.main(_run, p, argv, quiet=lambda args, cfg: cfg.run.quiet, configure=_configure,
                    first_step=resume_step_guess, settle=_settle, resumes=lambda args: args.resume or args.resume_auto)


if __name__ == "__main__":
    cli.leave(main())
