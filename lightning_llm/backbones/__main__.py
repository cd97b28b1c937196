"""``python -m lightning_llm.backbones fetch NAME [NAME ...]``: prepare backbones ahead of their first use."""

from __future__ import annotations

import argparse

from lightning_llm.backbones import available_backbones, fetch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_llm.backbones", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("fetch", help="build, download or convert backbones into $LIGHTNING_LLM_HOME")
    get.add_argument(
        "names", nargs="+", metavar="NAME", help=f"aliases ({', '.join(available_backbones())}) or hub ids"
    )
    args = parser.parse_args(argv)
    for name in args.names:
        print(f"{name}: {fetch(name)}")


if __name__ == "__main__":  # pragma: no cover
    main()
