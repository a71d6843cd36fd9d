"""How many values a model's block returns, read from its code: a pipeline's stand-in for
another piece's block (piece_parts.Skipped) must return them in the same form."""
import ast
import functools
import inspect
import textwrap


@functools.lru_cache(maxsize=None)
def values_returned(forward) -> int:
    """How many values a block's ``forward`` returns, read from its return statements: a
    tuple's length where every one returns a tuple of that length (Falcon-H1's blocks: one),
    else 0, one value not in a tuple (GLM-MoE-DSA's
    blocks return their indexer's top-k beside the hidden states, for the next block to
    reuse; annotations are no guide: many say a tuple and return a tensor). What is
    returned beside the hidden states does not cross stages: a block that needs it from
    another piece's fails on its absence (GLM-MoE-DSA's "shared" indexer layers)."""
    try:
        (function,) = ast.parse(textwrap.dedent(inspect.getsource(forward))).body
    except (OSError, TypeError, SyntaxError, ValueError):
        return 0
    found, todo = set(), list(function.body)
    while todo:  # (the function's own statements: not those of functions inside it)
        node = todo.pop()
        if isinstance(node, ast.Return):
            found.add(len(node.value.elts) if isinstance(node.value, ast.Tuple) else 0)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                   ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return found.pop() if len(found) == 1 else 0
