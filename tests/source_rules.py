"""Checkers over one source file's syntax tree (tests/test_imports.py runs them over src/): strings that name
another package's code, reaches into something else's private attributes, and torch.distributed collectives
that bypass the collective door (parallel/collective_hooks.py). Each returns "LINE: what" strings."""

from __future__ import annotations

import ast
import importlib
import re

# "paratrain.pkg.module" or "paratrain.pkg.module:function"
NAMED_CODE = re.compile(r"^(paratrain(?:\.\w+)+)(?::([\w.]+))?$")
# torch.distributed's functions that communicate
COLLECTIVES = frozenset({
    "all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_to_all", "all_to_all_single", "broadcast_object_list", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "send_object_list", "recv_object_list"})


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_of(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def string_references(source: str, module: str, modules: set[str], layer_of) -> list[str]:
    """Strings in `source` (the file of `module`) that name code of another package where an import would
    be seen: a "module:function" reference into another package, or any module of a higher layer."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        match = NAMED_CODE.match(node.value)
        if not match or match[1] not in modules or package_of(match[1]) == package_of(module):
            continue
        if match[2] or layer_of(match[1]) > layer_of(module):
            found.append(f"{node.lineno}: names {node.value}")
    return found


def imported_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted path it was imported as, from every import of the file (any scope)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                    alias.name.split(".")[0]
    return names


def own_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(the module's own classes, every name that stands for something of its own: its top-level classes,
    functions and globals, and names annotated with one of its classes)."""
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    own = set(classes)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            named = node.annotation.value if isinstance(node.annotation, ast.Constant) else \
                ast.unparse(node.annotation)
            if named in classes:
                own.add(node.arg)
    return classes, own


def resolve(dotted: str):
    """The object `dotted` names (a module, then attributes), or None where it does not import."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def private_reaches(source: str) -> list[str]:
    """Where `source` reads a private attribute of something not its own (`x._name`, getattr/hasattr(x,
    "_name")), patches one (an assignment, setattr/delattr), or overrides a private method of a base class from
    outside paratrain. Its own: self, cls, super(), the module's top-level classes, functions and globals, and
    names annotated with one of its classes."""
    tree = ast.parse(source)
    classes, own = own_names(tree)
    imports = imported_names(tree)

    def is_own(expr) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in ("self", "cls") or expr.id in own
        return isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "super"

    # torch._C._distributed_c10d._dump: one finding, the whole chain
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and is_private(n.attr)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and not is_own(node.value) and \
                id(node) not in inner:
            verb = "patches" if isinstance(node.ctx, (ast.Store, ast.Del)) else "reads"
            found.append(f"{node.lineno}: {verb} {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                is_private(node.args[1].value) and not is_own(node.args[0]):
            verb = "patches" if node.func.id in ("setattr", "delattr") else "reads"
            found.append(f"{node.lineno}: {verb} {ast.unparse(node.args[0])}.{node.args[1].value}")
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                dotted = ast.unparse(base)
                head, _, rest = dotted.partition(".")
                if head in classes or head not in imports or imports[head].split(".")[0] == "paratrain":
                    continue
                base_cls = resolve(f"{imports[head]}.{rest}" if rest else imports[head])
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and is_private(item.name) \
                            and base_cls is not None and hasattr(base_cls, item.name):
                        found.append(f"{item.lineno}: overrides {dotted}.{item.name}")
    return found


def collectives_outside_the_door(source: str) -> list[str]:
    """Calls of torch.distributed's collectives not made inside the arguments of a collective(...) call."""
    tree = ast.parse(source)
    dist_names = {name for name, path in imported_names(tree).items() if path == "torch.distributed"}
    inside = {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
              and call.func.id == "collective" for arg in (*call.args, *call.keywords) for n in ast.walk(arg)}

    def is_dist(expr) -> bool:
        return (isinstance(expr, ast.Name) and expr.id in dist_names) or ast.unparse(expr) == "torch.distributed"

    return [f"{node.lineno}: {ast.unparse(node.func)}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
            and is_dist(node.func.value) and id(node) not in inside]


# -- branches on a parallel dimension's name outside its package (tests/test_dim_branches.py) -----------------------
def _degree_named(expr, dims: set[str]) -> bool:
    """`x.tp`, `tp`, `x["tp"]`, or `(x.tp or 1)`: an expression that reads one of `dims`' degrees by name."""
    if isinstance(expr, ast.BoolOp):
        expr = expr.values[0]
    if isinstance(expr, ast.Attribute):
        return expr.attr in dims
    if isinstance(expr, ast.Name):
        return expr.id in dims
    return isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and expr.slice.value in dims


def _is_number(expr) -> bool:
    return isinstance(expr, ast.Constant) and type(expr.value) in (int, float)


def _names_in(expr) -> list[str]:
    """The string literals of `expr`: itself, or the items of a tuple, list or set literal."""
    items = expr.elts if isinstance(expr, (ast.Tuple, ast.List, ast.Set)) else [expr]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def degree_comparisons(source: str, dims: set[str]) -> list[str]:
    """Where `source` compares a dimension's degree, read by its name, with a number (`layout.tp > 1`, `pp == 1`,
    `(cfg.tp or 1) > 1`), asks whether one dimension by name is on (`layout.cp_enabled`), or reads a degree with
    getattr(x, "<dim>", default)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_degree_named(s, dims) for s in sides) and any(_is_number(s) for s in sides):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr.endswith("_enabled") and \
                node.attr.removesuffix("_enabled") in dims:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and \
                len(node.args) >= 2 and _names_in(node.args[1])[:1] and _names_in(node.args[1])[0] in dims:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def name_branches(source: str, dims: set[str]) -> list[str]:
    """Where `source` branches on a dimension's name: compares anything with it (`group == "tp"`, `d in ("tp",
    "cp")`), or lists two or more of them by hand (`for d in ("tp", "pp", "cp")`: what the registry lists)."""
    tree = ast.parse(source)
    found, compared = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(set(_names_in(s)) & dims for s in (node.left, *node.comparators)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
            compared.update(id(s) for s in node.comparators)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in compared and \
                len(set(_names_in(node)) & dims) >= 2:
            found.append(f"{node.lineno}: lists {ast.unparse(node)}")
    return found
