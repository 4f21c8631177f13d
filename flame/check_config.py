"""Validate a run config without starting anything: `python -m flame.check_config --config FILE [overrides]`.

Prints the resolved TOML, or with `--get section.key` only that value. Exit code 2 and one line on any error.
"""

from __future__ import annotations

import sys

from flame.config import ConfigError, load_config, to_toml


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    get = None
    if "--get" in argv:
        i = argv.index("--get")
        get = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i:i + 2]
    from flame.train import parse_args

    try:
        path, overrides = parse_args(argv)
        cfg = load_config(path, overrides)
        if not cfg.data.synthetic:
            from flame.data import check_sources

            check_sources(cfg.data)
        if get is None:
            print(to_toml(cfg), end="")
            return
        section, _, key = get.partition(".")
        if not hasattr(cfg, section) or not hasattr(getattr(cfg, section), key):
            raise ConfigError(get, "an existing section.key for --get")
        print(getattr(getattr(cfg, section), key))
    except ConfigError as e:
        print(e.line(), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
