"""Sphinx helpers of lowbit's docs: signatures drawn from the code, and a coverage check.

``.. op-signatures:: lowbit.linear_forward lowbit.linear_backward`` renders one line per
function, a link to its API entry and its parameters as ``inspect.signature`` reads them now
(annotations dropped, the return annotation kept), so the op table cannot drift from the code
when a signature changes; an unknown name is a build warning.

After reading every page, ``check_coverage`` warns about each public name that no page
documents: the names ``lowbit`` exports (its ``__all__``, subpackages included, which need an
``automodule``; without ``__all__``, every public attribute that is not a module), the
``__all__`` of ``lowbit.io``, ``lowbit.distributed`` and ``lowbit.models.bitnet``, and the
public classes and functions defined in ``lowbit.models.bdh`` and ``lowbit.models.train``. With ``sphinx-build -W`` a new
export without an entry fails the build.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

#: Modules whose ``__all__`` lists their public names.
ALL_MODULES = ("lowbit.io", "lowbit.distributed", "lowbit.models.bitnet")
#: Modules whose public classes and functions (defined there) are their public names.
DEFINING_MODULES = ("lowbit.models.bdh", "lowbit.models.train")


def _resolve(dotted: str):
    """The object at ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {dotted!r}")


def short_signature(obj) -> str:
    """``(a, b=1, *, c=None) -> ret`` of ``obj``: parameter names and defaults, the return
    annotation as written in the source (none for a class: its constructor's)."""
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    if params and params[0].name == "self":  # a method read from its class
        params = params[1:]
    text = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty and not inspect.isclass(obj):
        text += f" -> {ret if isinstance(ret, str) else inspect.formatannotation(ret)}"
    return text


class OpSignatures(SphinxDirective):
    """One bullet per named function: its API link and its current signature."""

    required_arguments = 1
    optional_arguments = 20
    has_content = False

    def run(self):
        lines = []
        for dotted in self.arguments:
            try:
                obj = _resolve(dotted)
                sig = short_signature(obj)
            except (ImportError, AttributeError, ValueError, TypeError) as exc:
                logger.warning("op-signatures: cannot read %s (%s)", dotted, exc,
                               location=self.get_location())
                continue
            role = ("class" if inspect.isclass(obj)
                    else "meth" if "." in getattr(obj, "__qualname__", "") else "func")
            lines.append(f"* :{role}:`{dotted}` ``{sig}``")
        if not lines:
            return []
        container = nodes.container(classes=["op-signatures"])
        self.state.nested_parse(StringList(lines, source=self.get_source_info()[0]),
                                self.content_offset, container)
        return [container]


def expected_names() -> list[str]:
    """Every public name the reference must document, as full dotted names."""
    import lowbit

    names = []
    exported = getattr(lowbit, "__all__", None)
    if exported is None:
        exported = [n for n in dir(lowbit) if not n.startswith("_")
                    and not isinstance(getattr(lowbit, n), types.ModuleType)]
    for name in exported:
        names.append(f"lowbit.{name}")  # modules too: each needs its automodule
    for module_name in ALL_MODULES:
        module = importlib.import_module(module_name)
        names += [f"{module_name}.{n}" for n in module.__all__]
    for module_name in DEFINING_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if getattr(obj, "__module__", None) == module_name:
                names.append(f"{module_name}.{name}")
    return sorted(set(names))


def check_coverage(app, env):
    domain = env.get_domain("py")
    documented = set(domain.objects) | set(domain.modules)
    for name in expected_names():
        if name not in documented:
            logger.warning("public name %s is documented on no page (add it to docs/api/)", name)


_ALIAS_REPR = re.compile(r"TypeAliasForwardRef\('([\w.]+)'\)")


def clean_signature(app, what, name, obj, options, signature, return_annotation):
    """Show ``autodoc_type_aliases`` names (``Array``) as their names inside unions and
    generics too, where autodoc prints the repr of its alias placeholder."""
    if signature is None and return_annotation is None:
        return None
    fix = (lambda text: text if text is None else _ALIAS_REPR.sub(r"\1", text))
    return fix(signature), fix(return_annotation)


def setup(app):
    app.add_directive("op-signatures", OpSignatures)
    app.connect("autodoc-process-signature", clean_signature)
    app.connect("env-check-consistency", check_coverage)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
