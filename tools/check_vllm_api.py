"""Check, by reading source only, that every vLLM API our code uses exists in a given vLLM build.

    python tools/check_vllm_api.py /tmp/vdl/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl   # a wheel
    python tools/check_vllm_api.py .venv/lib/python3.11/site-packages/vllm                       # a package dir
    python tools/check_vllm_api.py                                 # the installed vllm (located, not imported)

Our side: every module of remax_megatron that imports vllm, parsed with ast: the vLLM names it imports, the
calls on them with their keyword arguments (`**dict(...)`, `**name` and `**helper()` expanded to their keys),
the methods called and attributes read on vLLM objects (the types of names the ast cannot infer are declared
in LOCAL_TYPES), and the worker methods named in `collective_rpc("name", kwargs=...)`.
vLLM's side: its .py files, never imported (a CUDA wheel checks on a CPU-only machine): the module, the class
or function, each keyword a parameter of the function / __init__ (or a field of a dataclass or msgspec.Struct;
a `**kwargs` is followed to the call it is forwarded to), each attribute a method, property, field or
`self.x` assignment of the class or its vLLM bases; the types of chained attributes come from vLLM's
annotations.

Prints JSON, one entry per use: what, where (file:line in our code), status (found / missing / unverified:
the checker cannot tell), vllm (the build's declaration). Exit status 1 if anything is missing.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The class whose methods `llm.collective_rpc("name", ...)` runs (vLLM's CPUWorker subclasses it).
WORKER = "vllm.v1.worker.gpu_worker.Worker"
# Attributes that our code sets on vLLM classes itself (markers), not vLLM's.
OURS = ("_remax_",)

# What the ast cannot infer: the vLLM type of an expression of ours, per function ("[*]" is any subscript).
# (qualified name, instance?): False for a class itself.
LOCAL_TYPES: dict[str, dict[str, tuple[str, bool]]] = {
    "build_requests": {"params_cls": ("vllm.sampling_params.SamplingParams", False)},
    "build_row_requests": {"params_cls": ("vllm.sampling_params.SamplingParams", False)},
    "_completion": {"output": ("vllm.outputs.CompletionOutput", True), "step[*]": ("vllm.logprobs.Logprob", True)},
    "parse_outputs": {"outputs[*]": ("vllm.outputs.RequestOutput", True), "o": ("vllm.outputs.CompletionOutput", True)},
    "_generate_rows": {"o": ("vllm.outputs.RequestOutput", True)},
    "_reprocess_moe_experts": {
        "worker": (WORKER, True),
        "method": ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod", True),
    },
    "_own_pending": {"info": ("vllm.model_executor.model_loader.reload.types.LayerReloadingInfo", True)},
    "init_cpu_shm": {"self": ("vllm.distributed.device_communicators.cpu_communicator._CPUSHMDistributed", True)},
}
# Keys of `**name` that come from our own objects: name -> (keys, where they are made).
KNOWN_KEYS = {"guided": (("regex", "json"), "remax_megatron/rollout/engine.py SamplingParams.guided")}


# ---- vLLM's side -------------------------------------------------------------------------------------
@dataclass
class Def:
    """A definition in vLLM's source: kind is module, class, function or variable (a name or an attribute)."""

    qual: str
    kind: str
    node: ast.AST
    module: str  # the dotted module it is written in
    owner: Def | None = None  # the class of a method or attribute


class VllmSource:
    """vLLM's .py files from a wheel (zip) or a package directory; parsed modules are cached."""

    def __init__(self, path: Path):
        self.path = path
        self._zip = zipfile.ZipFile(path) if zipfile.is_zipfile(path) else None
        self._root = None if self._zip else path.parent
        self._cache: dict[str, tuple[ast.Module, str] | None] = {}

    def text(self, rel: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode()
            except KeyError:
                return None
        file = self._root / rel
        return file.read_text() if file.is_file() else None

    def module(self, dotted: str) -> tuple[ast.Module, str] | None:
        """(tree, file) of a module, or None."""
        if dotted not in self._cache:
            self._cache[dotted] = None
            base = dotted.replace(".", "/")
            for rel in (base + ".py", base + "/__init__.py"):
                text = self.text(rel)
                if text is not None:
                    self._cache[dotted] = (ast.parse(text), rel)
                    break
        return self._cache[dotted]

    def version(self) -> str:
        found = re.search(r"__version__ = version = '([^']+)'", self.text("vllm/_version.py") or "")
        return found.group(1) if found else "unknown"

    def where(self, d: Def) -> str:
        return f"{self.module(d.module)[1]}:{getattr(d.node, 'lineno', 1)}"


def lookup(src: VllmSource, qual: str, depth: int = 0) -> Def | None:
    """The definition of a dotted name: the longest prefix that is a module, then its members."""
    parts = qual.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if src.module(name):
            break
    else:
        return None
    d = Def(name, "module", src.module(name)[0], name)
    for part in parts[i:]:
        d = member(src, d, part, depth + 1)
        if d is None:
            return None
    return d


def _top_level(body: list[ast.stmt]):
    """A module's statements, including those inside if/try blocks (TYPE_CHECKING imports, fallbacks)."""
    for stmt in body:
        yield stmt
        for block in ("body", "orelse", "finalbody"):
            if isinstance(stmt, ast.If | ast.Try) and block in stmt._fields:
                yield from _top_level(getattr(stmt, block))
        for handler in getattr(stmt, "handlers", []):
            yield from _top_level(handler.body)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def module_member(src: VllmSource, mod: str, name: str, depth: int) -> Def | None:
    """A module-level name: a def, a class, an assignment, an import (followed), a lazy attribute, a submodule."""
    if depth > 12:
        return None
    tree, rel = src.module(mod)
    for stmt in _top_level(tree.body):
        if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
            return Def(f"{mod}.{name}", "class" if isinstance(stmt, ast.ClassDef) else "function", stmt, mod)
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    origin = _absolute(mod, rel.endswith("__init__.py"), stmt)
                    return lookup(src, f"{origin}.{alias.name}", depth)
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname == name:
                    return lookup(src, alias.name, depth)
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and any(_name(t) == name for t in targets):
            if isinstance(stmt.value, ast.Name) and stmt.value.id != name:  # an alias: X = Y
                return module_member(src, mod, stmt.value.id, depth + 1)
            if isinstance(stmt, ast.AnnAssign) or stmt.value is not None:
                return Def(f"{mod}.{name}", "variable", stmt, mod)
    return _lazy_member(src, mod, tree, name, depth)


def _lazy_member(src: VllmSource, mod: str, tree: ast.Module, name: str, depth: int) -> Def | None:
    """vLLM's lazy module attributes (a MODULE_ATTRS table or a module __getattr__), else a submodule."""
    for stmt in _top_level(tree.body):
        if isinstance(stmt, ast.Assign) and _name(stmt.targets[0]) == "MODULE_ATTRS":
            table = ast.literal_eval(stmt.value)
            if name in table:
                target, attr = table[name].split(":")
                return lookup(src, f"{mod}{target}.{attr}" if target.startswith(".") else f"{target}.{attr}", depth)
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__getattr__":
            if any(isinstance(c, ast.Constant) and c.value == name for c in ast.walk(stmt)):
                return Def(f"{mod}.{name}", "variable", stmt, mod)
    sub = f"{mod}.{name}"
    return Def(sub, "module", src.module(sub)[0], sub) if src.module(sub) else None


def _name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def member(src: VllmSource, d: Def, name: str, depth: int = 0) -> Def | None:
    """An attribute of a definition: of a module, a class (with its vLLM bases), or an annotated variable."""
    if d.kind == "module":
        return module_member(src, d.module if d.qual == d.module else d.qual, name, depth)
    cls = d if d.kind == "class" else type_of(src, d)
    return class_member(src, cls, name) if cls is not None else None


def bases(src: VllmSource, cls: Def) -> list[Def]:
    """The vLLM classes a class derives from (others, e.g. msgspec.Struct or ABC, are not followed)."""
    found = []
    for base in cls.node.bases:
        base = base.value if isinstance(base, ast.Subscript) else base  # Generic[T], Base[T]
        d = resolve_in_module(src, cls.module, base)
        if d is not None and d.kind == "class":
            found.append(d)
    return found


def class_member(src: VllmSource, cls: Def, name: str, seen: int = 0) -> Def | None:
    """A method, class attribute or field, or a `self.name` assignment in a method; then the bases'."""
    assigned = None
    for stmt in cls.node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
            return Def(f"{cls.qual}.{name}", "function", stmt, cls.module, cls)
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and any(_name(t) == name for t in targets):
            return Def(f"{cls.qual}.{name}", "variable", stmt, cls.module, cls)
    for node in ast.walk(cls.node):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets if isinstance(node, ast.Assign | ast.AnnAssign) else ():
            if isinstance(t, ast.Attribute) and _name(t.value) == "self" and t.attr == name:
                if isinstance(node, ast.AnnAssign) or assigned is None:  # an annotated one says the type
                    assigned = Def(f"{cls.qual}.{name}", "variable", node, cls.module, cls)
    if assigned is not None:
        return assigned
    for base in bases(src, cls) if seen < 20 else ():
        found = class_member(src, base, name, seen + 1)
        if found is not None:
            return found
    return None


def resolve_in_module(src: VllmSource, mod: str, expr: ast.AST) -> Def | None:
    """A Name or dotted Attribute, or a string annotation, as written in vLLM module `mod`."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        try:
            expr = ast.parse(expr.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(expr, ast.Name):
        return module_member(src, mod, expr.id, 0)
    if isinstance(expr, ast.Attribute):
        base = resolve_in_module(src, mod, expr.value)
        return member(src, base, expr.attr) if base is not None else None
    return None


def annotation_class(src: VllmSource, mod: str, ann: ast.AST | None) -> Def | None:
    """The vLLM class an annotation names: X, "X", X | None, Optional[X]."""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(ann, ast.BinOp):
        return annotation_class(src, mod, ann.left) or annotation_class(src, mod, ann.right)
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return annotation_class(src, mod, ann.slice)
    d = resolve_in_module(src, mod, ann) if ann is not None else None
    return d if d is not None and d.kind == "class" else None


def type_of(src: VllmSource, d: Def) -> Def | None:
    """The class of a variable or property, from vLLM's annotation, the annotated parameter it is set from, or the call
    that makes it (a class, or a function's / classmethod's return annotation)."""
    node = d.node
    if isinstance(node, ast.FunctionDef):  # a property: its return annotation
        names = {ast.unparse(dec).split(".")[-1] for dec in node.decorator_list}
        return annotation_class(src, d.module, node.returns) if names & {"property", "cached_property"} else None
    if isinstance(node, ast.AnnAssign):
        return annotation_class(src, d.module, node.annotation)
    value = getattr(node, "value", None)
    if isinstance(value, ast.Name) and d.owner is not None:  # self.x = x, x an annotated parameter
        for fn in ast.walk(d.owner.node):
            if isinstance(fn, ast.FunctionDef) and any(node is n for n in ast.walk(fn)):
                args = fn.args.args + fn.args.kwonlyargs
                return next((annotation_class(src, d.module, a.annotation) for a in args if a.arg == value.id), None)
    if isinstance(value, ast.Call):
        func = value.func
        if isinstance(func, ast.Attribute) and _name(func.value) == "self" and d.owner is not None:
            made = class_member(src, d.owner, func.attr)
        else:
            made = resolve_in_module(src, d.module, func)
        if made is not None and made.kind == "class":
            return made
        if made is not None and made.kind == "function":
            return annotation_class(src, made.module, made.node.returns)
    return None


@dataclass
class Signature:
    """What a call accepts: named parameters (name -> (declaration, where)), whether it takes **kwargs,
    and the calls its **kwargs are forwarded to."""

    params: dict[str, tuple[str, str]] = field(default_factory=dict)
    var_kw: bool = False
    forwards: list[Def] = field(default_factory=list)
    text: str = ""


def signature(src: VllmSource, d: Def) -> Signature | None:
    """A function's parameters; a class's __init__ (its own or a vLLM base's), else its dataclass/Struct fields."""
    if d.kind == "function":
        return _function_signature(src, d)
    if d.kind != "class":
        return None
    init = class_member(src, d, "__init__")
    if init is not None and init.kind == "function":
        return _function_signature(src, init)
    sig = Signature()
    for cls in _mro(src, d):
        for stmt in cls.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                name, where = stmt.target.id, src.where(Def("", "", stmt, cls.module))
                if "ClassVar" not in ast.unparse(stmt.annotation) and name not in sig.params:
                    sig.params[name] = (ast.unparse(stmt).split("\n")[0], where)
    sig.text = f"{d.qual}: fields " + ", ".join(sig.params)
    return sig


def _mro(src: VllmSource, cls: Def, depth: int = 0) -> list[Def]:
    return [cls] + [c for b in bases(src, cls) if depth < 20 for c in _mro(src, b, depth + 1)]


def _function_signature(src: VllmSource, fn: Def) -> Signature:
    args = fn.node.args
    where = src.where(fn)
    sig = Signature(text=f"{fn.qual}({ast.unparse(args)})", var_kw=args.kwarg is not None)
    for a in args.posonlyargs + args.args + args.kwonlyargs:
        decl = a.arg + (f": {ast.unparse(a.annotation)}" if a.annotation is not None else "")
        sig.params[a.arg] = (decl, where)
    if args.kwarg is not None:
        for call in ast.walk(fn.node):
            if isinstance(call, ast.Call) and any(
                k.arg is None and _name(k.value) == args.kwarg.arg for k in call.keywords
            ):
                target = _callee(src, fn, call.func)
                if target is not None:
                    sig.forwards.append(target)
    return sig


def _callee(src: VllmSource, fn: Def, func: ast.AST) -> Def | None:
    """What a call inside vLLM function `fn` calls: a module-level name, or a method of self / self.attr."""
    if isinstance(func, ast.Attribute) and fn.owner is not None:
        if _name(func.value) == "self":
            return class_member(src, fn.owner, func.attr)
        if isinstance(func.value, ast.Attribute) and _name(func.value.value) == "self":
            attr = class_member(src, fn.owner, func.value.attr)
            cls = type_of(src, attr) if attr is not None else None
            return class_member(src, cls, func.attr) if cls is not None else None
    return resolve_in_module(src, fn.module, func)


def check_keyword(src: VllmSource, sig: Signature, name: str, depth: int = 0) -> tuple[str, str]:
    """(status, the build's declaration) of keyword `name` in a call with this signature."""
    if name in sig.params:
        decl, where = sig.params[name]
        return "found", f"{where} {decl}"
    if not sig.var_kw:
        return "missing", f"not a parameter of {sig.text[:300]}"
    results = []
    for target in sig.forwards:
        inner = signature(src, target) if depth < 4 else None
        if inner is not None:
            status, decl = check_keyword(src, inner, name, depth + 1)
            results.append((status, f"{decl} (via **kwargs of {sig.text.split('(')[0]})"))
    for wanted in ("found", "missing"):  # found by any forward wins; missing only where it was followed
        for status, decl in results:
            if status == wanted:
                return status, decl
    return "unverified", f"accepted by **kwargs of {sig.text[:200]}, not followed"


# ---- our side ----------------------------------------------------------------------------------------
@dataclass
class Use:
    """One use of vLLM in our code. kind: import, call (of base itself), method or attribute (`name` on
    base.path); base: (qualified name, instance?) of the vLLM object it starts from."""

    kind: str
    base: tuple[str, bool] | None
    path: list[str]
    name: str
    keywords: list[tuple[str, int]]
    where: str
    text: str


def our_modules() -> list[Path]:
    """The modules of remax_megatron that import vllm."""
    pattern = re.compile(r"^\s*(from vllm[\s.]|import vllm\b)", re.M)
    return sorted(p for p in (REPO / "remax_megatron").rglob("*.py") if pattern.search(p.read_text()))


def _norm(expr: ast.AST) -> str:
    """An expression's source text with every subscript written [*]."""
    if isinstance(expr, ast.Subscript):
        return f"{_norm(expr.value)}[*]"
    if isinstance(expr, ast.Attribute):
        return f"{_norm(expr.value)}.{expr.attr}"
    return ast.unparse(expr)


def file_bindings(tree: ast.Module, rel: str) -> tuple[dict, list[Use]]:
    """Names bound to vLLM objects anywhere in a file: its vllm imports, and `self.x = <vLLM name>` or
    `self.x = <vLLM class>(...)`; and one import use per imported name."""
    env, uses = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] == "vllm":
            for a in node.names:
                env[a.asname or a.name] = (f"{node.module}.{a.name}", False)
                text = f"from {node.module} import {a.name}"
                uses.append(Use("import", None, [], f"{node.module}.{a.name}", [], f"{rel}:{node.lineno}", text))
        if isinstance(node, ast.Import):
            for a in (a for a in node.names if a.name.split(".")[0] == "vllm"):
                env[a.asname or a.name] = (a.name, False)
                uses.append(Use("import", None, [], a.name, [], f"{rel}:{node.lineno}", f"import {a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            target, value = _norm(node.targets[0]), node.value
            if _norm(value) in env:
                env[target] = env[_norm(value)]
            elif isinstance(value, ast.Call) and _norm(value.func) in env and not env[_norm(value.func)][1]:
                env[target] = (env[_norm(value.func)][0], True)
    return env, uses


def _chain(expr: ast.AST, env: dict) -> tuple[tuple[str, bool], list[str]] | None:
    """(bound vLLM object, attribute path) of an expression like bound.a.b, or None."""
    path = []
    while _norm(expr) not in env:
        if not isinstance(expr, ast.Attribute):
            return None
        path.append(expr.attr)
        expr = expr.value
    return env[_norm(expr)], path[::-1]


def _keys(expr: ast.AST, fn: ast.AST, tree: ast.Module, depth: int = 0) -> list[tuple[str, int]]:
    """The keys of a `**expr`: a dict literal, dict(...), a conditional of those, a local name (its
    assignments and item stores), a helper of this file (its returns), or KNOWN_KEYS."""
    line = expr.lineno
    if isinstance(expr, ast.Dict):
        return [(k.value if isinstance(k, ast.Constant) else f"**{ast.unparse(expr)}", line) for k in expr.keys]
    if isinstance(expr, ast.IfExp):
        return _keys(expr.body, fn, tree, depth) + _keys(expr.orelse, fn, tree, depth)
    if isinstance(expr, ast.Call) and _name(expr.func) == "dict":
        return _keywords(expr, fn, tree, depth)
    if isinstance(expr, ast.Name) and expr.id in KNOWN_KEYS:
        return [(k, line) for k in KNOWN_KEYS[expr.id][0]]
    found = []
    if isinstance(expr, ast.Name) and depth < 5:
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _name(node.targets[0]) == expr.id:
                found += _keys(node.value, fn, tree, depth + 1)
            target = node.targets[0] if isinstance(node, ast.Assign) else None
            if isinstance(target, ast.Subscript) and _name(target.value) == expr.id:
                found.append((target.slice.value if isinstance(target.slice, ast.Constant) else "?", node.lineno))
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and depth < 5:
        for helper in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == expr.func.id):
            for ret in (r for r in ast.walk(helper) if isinstance(r, ast.Return) and r.value is not None):
                found += _keys(ret.value, helper, tree, depth + 1)
    return found or [(f"**{ast.unparse(expr)}", line)]


def _keywords(call: ast.Call, fn: ast.AST, tree: ast.Module, depth: int = 0) -> list[tuple[str, int]]:
    found = []
    for k in call.keywords:
        found += [(k.arg, k.lineno)] if k.arg else _keys(k.value, fn, tree, depth + 1)
    return found


def call_uses(call: ast.Call, env: dict, fn: ast.AST, tree: ast.Module, rel: str) -> list[Use]:
    """A call of a vLLM class or function, getattr/hasattr on a vLLM object, a method of a vLLM object
    (and the worker method a collective_rpc names)."""
    text, where = _norm(call.func), f"{rel}:{call.lineno}"
    if text in env and not env[text][1]:
        return [Use("call", env[text], [], "", _keywords(call, fn, tree), where, f"{text}(...)")]
    if text in ("getattr", "hasattr") and len(call.args) > 1 and isinstance(call.args[1], ast.Constant):
        base = _chain(call.args[0], env)
        if base is None or call.args[1].value.startswith(OURS):
            return []
        return [Use("attribute", base[0], base[1], call.args[1].value, [], where, ast.unparse(call))]
    base = _chain(call.func.value, env) if isinstance(call.func, ast.Attribute) else None
    if base is None:
        return []
    uses = [Use("method", base[0], base[1], call.func.attr, _keywords(call, fn, tree), where, f"{text}(...)")]
    if call.func.attr == "collective_rpc" and call.args and isinstance(call.args[0], ast.Constant):
        rpc = next((k.value for k in call.keywords if k.arg == "kwargs"), None)
        keys = _keys(rpc, fn, tree) if rpc is not None else []
        name = call.args[0].value
        uses.append(Use("method", (WORKER, True), [], name, keys, where, f"worker.{name}(...) via collective_rpc"))
    return uses


def collect(path: Path) -> list[Use]:
    """Every vLLM use in one of our files, each once."""
    tree, rel = ast.parse(path.read_text()), str(path.relative_to(REPO))
    env, uses = file_bindings(tree, rel)
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for scope in reversed(scopes):  # innermost first: a use is kept with the bindings of its own function
        local = {**env, **LOCAL_TYPES.get(getattr(scope, "name", ""), {})}
        funcs = set()
        for node in ast.walk(scope):
            if isinstance(node, ast.Call):
                uses += call_uses(node, local, scope, tree, rel)
                funcs.add(id(node.func))
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and id(node) not in funcs and not node.attr.startswith(OURS):
                base = _chain(node.value, local)
                if base is not None:
                    uses.append(Use("attribute", base[0], base[1], node.attr, [], f"{rel}:{node.lineno}", _norm(node)))
    unique = {}
    for use in uses:
        unique.setdefault((use.kind, use.base, tuple(use.path), use.name, use.where), use)
    return list(unique.values())


# ---- the check ---------------------------------------------------------------------------------------
def resolve(src: VllmSource, qual: str, path: list[str]) -> tuple[Def | None, str, str]:
    """(definition, status, reason) of a vLLM name followed by attributes; status is found, missing, or
    unverified where an attribute's type is not known from vLLM's annotations."""
    d = lookup(src, qual)
    if d is None:
        return None, "missing", f"{qual} not found"
    for attr in path:
        if d.kind in ("variable", "function") and type_of(src, d) is None:
            declared = ast.unparse(d.node).split("\n")[0][:120]
            return None, "unverified", f"{d.qual}: its type is not a vLLM class known from the source ({declared})"
        found = member(src, d, attr)
        if found is None:
            return None, "missing", f"{d.qual} has no {attr}"
        d = found
    return d, "found", ""


def _describe(src: VllmSource, d: Def) -> str:
    sig = signature(src, d) if d.kind in ("class", "function") else None
    text = sig.text if sig is not None else ast.unparse(d.node).split("\n")[0]
    return f"{src.where(d)} {text[:300]}"


def check_use(src: VllmSource, use: Use) -> list[dict]:
    """The entries for one use: the object itself, then one per keyword argument."""
    entry = {"what": use.text, "where": use.where}
    if use.kind == "import":
        d = lookup(src, use.name)
        return [{**entry, "status": "found" if d else "missing", "vllm": _describe(src, d) if d else ""}]
    names = use.path + ([use.name] if use.name else [])
    d, status, reason = resolve(src, use.base[0], names)
    if d is None:
        return [{**entry, "status": status, "vllm": reason}]
    entries = [{**entry, "status": "found", "vllm": _describe(src, d)}]
    sig = signature(src, d) if use.keywords else None
    for keyword, line in use.keywords:
        what = f"{use.text.removesuffix('(...)')}({keyword}=...)"
        where = f"{use.where.split(':')[0]}:{line}"
        if keyword.startswith("**") or sig is None:
            entries.append({"what": what, "where": where, "status": "unverified", "vllm": "keys not known"})
            continue
        status, decl = check_keyword(src, sig, keyword)
        entries.append({"what": what, "where": where, "status": status, "vllm": decl})
    return entries


def installed_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed here: give a wheel or a vllm package directory")
    return Path(list(spec.submodule_search_locations)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("vllm", nargs="?", type=Path, help="a vLLM wheel or package directory (default: installed)")
    args = parser.parse_args(argv)
    src = VllmSource(args.vllm or installed_vllm())
    entries = [e for path in our_modules() for use in collect(path) for e in check_use(src, use)]
    counts = {s: sum(e["status"] == s for e in entries) for s in ("found", "missing", "unverified")}
    report = {"vllm": str(src.path), "version": src.version(), "counts": counts, "checks": entries}
    print(json.dumps(report, indent=1))
    return 1 if counts["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
