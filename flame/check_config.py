"""Validate a run config without starting anything: `python -m flame.check_config --config FILE [overrides]`.

Prints the resolved TOML, or with `--get section.key` only that value. A config error is one line and exit code 2.
The data checks (source globs, files, formats, tokenizer) depend on the machine: a config written for a cluster
names paths that exist only there, so by default a data problem is a warning and the exit code stays 0;
`--strict` makes it an error (exit 2), `--no-data-check` skips those checks.
"""

from __future__ import annotations

import sys

from flame.config import ConfigError, load_config, parse_config_args, resolve_dp_degrees, to_toml

USAGE = """usage: python -m flame.check_config --config FILE [--section.key=value ...] [--get section.key]
                                   [--strict | --no-data-check] [--world-size N]

Check a run config as flame.train would (names, types, ranges, then the data), without starting anything.
Prints the resolved TOML, or only the value of --get section.key.

  --config FILE        the TOML file
  --section.key=value  overrides, as flame.train takes them
  --get section.key    print only this value
  --strict             a data problem (a source glob that matches nothing here, a missing tokenizer) is an error
  --no-data-check      skip the data checks
  --world-size N       the number of processes the run will have: the parallel layout must fit it
Exit code 0: valid (data problems, if any, printed as warnings); 2: a config error (one line on stderr)."""


def data_problems(cfg) -> list[ConfigError]:
    """Every source, eval source and the tokenizer checked on their own, so that all problems are named at once."""
    from flame.data.sources import plan_source
    from flame.data.tokenizer import load_tokenizer

    problems = []
    for which in ("sources", "eval_sources"):
        for i, source in enumerate(getattr(cfg.data, which)):
            try:
                plan_source(source, f"data.{which}[{i}]", i)
            except ConfigError as e:
                problems.append(e)
    try:
        load_tokenizer(cfg.data)
    except ConfigError as e:
        problems.append(e)
    return problems


def take_flag(argv: list[str], flag: str) -> bool:
    found = flag in argv
    while flag in argv:
        argv.remove(flag)
    return found


def take_value(argv: list[str], flag: str) -> str | None:
    """The value after `flag` ("" when it is last), removed from argv with it; None without the flag."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = argv[i + 1] if i + 1 < len(argv) else ""
    del argv[i:i + 2]
    return value


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return
    strict, skip_data = take_flag(argv, "--strict"), take_flag(argv, "--no-data-check")
    get, world = take_value(argv, "--get"), take_value(argv, "--world-size")
    try:
        if strict and skip_data:
            raise ConfigError("--strict", "either --strict or --no-data-check, not both")
        path, overrides = parse_config_args(argv)
        cfg = load_config(path, overrides)
        if world is not None:
            if not world.isdigit() or int(world) < 1:
                raise ConfigError("--world-size", "a number of processes >= 1", world)
            try:
                resolve_dp_degrees(cfg.parallelism, int(world))
            except ConfigError as e:
                e.file = path
                raise
        if get is not None:
            section, _, key = get.partition(".")
            if not hasattr(cfg, section) or not hasattr(getattr(cfg, section), key):
                raise ConfigError(get, "an existing section.key for --get")
        problems = [] if cfg.data.synthetic or skip_data else data_problems(cfg)
        for e in problems:
            e.file = path
            if strict:
                raise e
            print(f"warning: {e.line().removeprefix('config error: ')} (a data check: a warning only; "
                  "--strict makes it an error)", file=sys.stderr)
    except ConfigError as e:
        print(e.line(), file=sys.stderr)
        sys.exit(2)
    if get is None:
        print(to_toml(cfg), end="")
    else:
        print(getattr(getattr(cfg, section), key))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while scripts/launch.sh checks the config: a requested stop, no traceback
        sys.exit(130)
