"""Modules imported at their first use. torch takes 5-15 s to import on an idle core (more on a busy machine) and
transformers as much again, and the command line must answer a mistyped flag or --help before that. The modules
the flags are read from (loss.py's LossConfig and registry, tiny.py's task names, runfolder/'s run-folder checks)
therefore name torch through module() instead of importing it: it is imported when one of their functions first
uses it, and the scripts import it as usual once the command line is read.
"""

import importlib


def module(name: str, namespace: dict, binding: str | None = None):
    """A stand-in for the module `name`, bound as `binding` (default: the name's last part) in `namespace` (the
    caller's globals()). The first read of one of its attributes imports the module (an ordinary import: its errors,
    and a Ctrl-C during it, surface there) and puts the module itself in the stand-in's place, so the caller's later
    uses cost nothing more than an import's."""
    return _Later(name, namespace, binding or name.rpartition(".")[2])


class _Later:
    def __init__(self, name, namespace, binding):
        self._name, self._namespace, self._binding = name, namespace, binding

    def __getattr__(self, attr):  # only for what the stand-in lacks: every attribute of the module
        found = importlib.import_module(self._name)
        if self._namespace.get(self._binding) is self:
            self._namespace[self._binding] = found
        return getattr(found, attr)

    def __repr__(self):
        return f"<{self._name}, imported at its first use>"
