"""Command-line flags from dataclasses: one flag per field (`--eps-low` for `eps_low`), its help text the comment
beside the field, booleans as --x / --no-x. Errors are one line and exit code 2 (no usage block). Plumbing for
train.py; nothing here is about the algorithm."""

import argparse
import inspect


def field_docs(cls) -> dict:
    """One-line docs of a dataclass's fields, read from the comments beside them."""
    docs = {}
    for line in inspect.getsource(cls).splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith("#"):
            docs[line.split(":")[0]] = line.split("#", 1)[1].strip()
    return docs


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_flags(parser, dataclass_fields, docs, defaults, aliases=None, note=lambda name: ""):
    """A flag per field; its shown default is getattr(defaults, name); its parsed default None (= not given)."""
    for f in dataclass_fields:
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help_text = f"{docs.get(f.name, '')}{note(f.name)} (default: {default!r})"
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str) else f.type
            parser.add_argument(flag, *(aliases or {}).get(f.name, []), dest=f.name, type=kind, default=None,
                                help=help_text, metavar=kind.__name__.upper())


def join_negative_values(argv):
    """argparse takes "-1e-4" for an option ("expected one argument"): write such values as --flag=-1e-4."""
    out = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and token.startswith("-") and _is_number(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False
