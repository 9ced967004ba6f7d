"""Flags from dataclasses, for train.py and evaluate.py (cegppo_utils/cli.py on it): argparse with every error in one
line and exit code 2, a field's one-line doc as its help, booleans as --x / --no-x, foreign or mistyped names
answered with the flag they most likely mean."""

import argparse
import functools
import inspect
import os
import types

import loss as L
from cegppo_utils import runfolder as RF


def refuse_empty(parser, names):
    """An empty value (an unset shell variable: `--config "$CFG"`) is a mistake, not "use the default": one line."""
    if names:
        parser.error(f"--{names[0].replace('_', '-')} is empty (an unset shell variable?); give it a value, or leave "
                     "the flag out")


def refuse_unknown(parser, argv, known):
    """Unknown --flags (each with the value after it) refused in one line before argparse reads the command line:
    argparse's time grows with the square of the unknown flags (10,000 took 9 s)."""
    unknown = []
    for i, token in enumerate(argv):
        if token.startswith("--") and token != "--" and token.split("=", 1)[0] not in known:
            value = "=" not in token and i + 1 < len(argv) and not argv[i + 1].startswith("-")
            unknown += [token, argv[i + 1]] if value else [token]
    if unknown:
        parser.known = known  # the names Parser.error suggests from, where the parser has no flags yet
        parser.error("unrecognized arguments: " + " ".join(unknown))


# Names other trainers (HF Trainer, TRL) give these settings: a config or command line using them gets this hint.
SYNONYMS = {"learning_rate": "lr", "num_generations": "n", "group_size": "n", "max_grad_norm": "grad_clip",
            "max_completion_length": "max_response_len", "max_prompt_length": "max_prompt_len",
            "num_train_steps": "max_steps", "epsilon": "eps_low", "epsilon_high": "eps_high", "beta": "kl_coef",
            "warmup": "warmup_steps", "model_name_or_path": "model", "dataset": "train_data"}


def closest_flag(name: str, names) -> str | None:
    """The flag a mistyped or foreign name most likely means (SYNONYMS first, then spelling), or None."""
    name = name.lstrip("-").replace("-", "_")
    if name in SYNONYMS and SYNONYMS[name] in names:
        return SYNONYMS[name]
    return L.closest(name, names)


def dash_flags(argv):
    """--max_steps (the HF / TRL spelling) -> --max-steps; values are left alone."""
    out = []
    for token in argv:
        if token.startswith("--") and "_" in token.split("=", 1)[0]:
            name, eq, value = token.partition("=")
            token = name.replace("_", "-") + eq + value
        out.append(token)
    return out


@functools.cache  # inspect.getsource parses the whole module: read each dataclass once per process
def field_docs(cls) -> dict:
    """{field: (its --help group, its one-line doc)}, read from a dataclass's source: the comment beside each field
    (with the comment lines right below it, indented deeper than the field, that carry on a long one), and the
    `# --- group` comment above it ("algorithm" for LossConfig, which has none). Read-only: one copy serves every
    call."""
    docs, group, last = {}, "algorithm", None  # last: (the field whose comment may go on, its indent)
    for source_line in inspect.getsource(cls).splitlines():
        line = source_line.strip()
        indent = len(source_line) - len(source_line.lstrip())
        if last and line.startswith("#") and indent > last[1]:
            name = last[0]
            docs[name] = (docs[name][0], docs[name][1] + " " + line[1:].strip())
            continue
        last = None
        if line.startswith("# ---"):
            group = line[5:].split(":")[0].strip()
        elif ":" in line and "#" in line and not line.startswith("#"):
            docs[line.split(":")[0]] = (group, line.split("#", 1)[1].strip())
            last = (line.split(":")[0], indent)
    return types.MappingProxyType(docs)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's default, said once: not where its help already says it, nor
    where there is none (None)."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, exit code 2 (runfolder.one_line: control characters escaped, huge values cut), printed by rank 0
        alone under torchrun (RANK, set before anything starts; every rank ends); unknown flags: the first few, each
        with the closest known one (10,000 of them are not listed, nor matched, one by one)."""
        if message.startswith("unrecognized arguments:"):
            known = getattr(self, "known", None) or [o for action in self._actions for o in action.option_strings]
            names = {o.lstrip("-").replace("-", "_"): o for o in known if o.startswith("--")}
            unknown = message.split(":", 1)[1].split()
            shown = unknown[:UNKNOWN_SHOWN]
            message = "unrecognized arguments: " + " ".join(shown)
            if len(unknown) > len(shown):
                message += f" and {len(unknown) - len(shown)} more"
            hints = [f"{flag} -> {names[close]}" for flag in shown if flag.startswith("--")
                     for close in [closest_flag(flag.split("=")[0], names)] if close]
            if hints:
                message += f" (did you mean: {', '.join(hints)}?)"
        if os.environ.get("RANK", "0") != "0":  # under torchrun every rank reads the same flags: rank 0 says it once
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {RF.one_line(message)}\n")


UNKNOWN_SHOWN = 5  # unknown arguments named in the error line; the rest are counted


def field_type(f) -> type:
    """A dataclass field's type, also where its annotation is a string."""
    if isinstance(f.type, str):
        return {"int": int, "float": float, "str": str, "bool": bool}.get(f.type, f.type)
    return f.type


# Every number typed on a command line is read by loss.py's parse_int / parse_float, the one reading of a number
# (a value beyond a float's range is said so, not read as inf), and checked by its field's loss.Rule.
NUMBER = {int: L.parse_int, float: L.parse_float}


def bounded_int(text: str) -> int:
    """A tool's whole-number flag (cli.py): loss.parse_int, below 2**31 in size as every integer setting of a
    run is (a count of 401 digits is a mistake, not hours of work); each tool checks its own lower bound."""
    value = L.parse_int(text)
    if abs(value) >= 2**31:
        raise argparse.ArgumentTypeError(f"{L.shown(value)} must be below 2**31")
    return value


bounded_int.__name__ = "int"


def add_flags(parser, dataclass_fields, docs, defaults, aliases=None, note=lambda name: ""):
    """A flag per field, in its group; its shown default is the value under the preset (defaults: an Args, whose
    .loss holds the LossConfig fields); its parsed default None (= not given)."""
    groups = {}
    for f in dataclass_fields:
        group_name, doc = docs.get(f.name, ("other", ""))
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name) if hasattr(defaults, f.name) else getattr(defaults.loss, f.name)
        rule = f.metadata.get("rule")
        options = rule.options() if rule is not None else None
        help_text = f"{doc}{note(f.name)} (default: {default!r})"
        kind = field_type(f)
        if kind is bool:
            groups[group_name].add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            metavar = "{" + ",".join(map(str, options)) + "}" if options else kind.__name__.upper()
            groups[group_name].add_argument(flag, *(aliases or {}).get(f.name, []), dest=f.name,
                                            type=NUMBER.get(kind, kind), default=None, help=help_text, metavar=metavar)


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
