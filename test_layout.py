"""
Tests of the repository's shape, which every source file shares: no two modules import each other
(directly or around a longer circle), no Python file over 1,000 lines, no module named like an
installed package.

$ python -m pytest test_layout.py -q
"""
import ast
import importlib.metadata
import os

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDERS = ('', 'study')  # where the project's modules live (each runs with the root on sys.path)


def sources():
    """{module name: path} of the project's Python files (tests included)."""
    out = {}
    for folder in FOLDERS:
        for fn in sorted(os.listdir(os.path.join(HERE, folder))):
            if fn.endswith('.py'):
                out[fn[:-3]] = os.path.join(HERE, folder, fn)
    return out


def is_main_block(node):
    """`if __name__ == '__main__':`: a script's entry, not an import of the module."""
    t = node.test
    return (isinstance(node, ast.If) and isinstance(t, ast.Compare) and isinstance(t.left, ast.Name)
            and t.left.id == '__name__')


def imports(path, names):
    """The project modules path imports anywhere (top level or inside functions), except in its
    `if __name__ == '__main__'` block."""
    found, todo = set(), [ast.parse(open(path).read())]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_main_block(child):
                continue
            if isinstance(child, ast.Import):
                found |= {a.name.split('.')[0] for a in child.names}
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module.split('.')[0])
            todo.append(child)
    return found & set(names)


def cycle(graph):
    """One import circle as a list of modules, or None (depth-first search)."""
    state, stack = {}, []

    def visit(m):
        state[m] = 'open'
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 'open':
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 'done'
        stack.pop()
        return None
    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circles():
    src = sources()
    graph = {m: imports(p, src) - {m} for m, p in src.items()}
    assert cycle(graph) is None, f"modules import each other: {' -> '.join(cycle(graph))}"


def test_cycle_finder_finds_a_circle():
    assert cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
    assert cycle({'a': {'b'}, 'b': set()}) is None


def test_no_python_file_over_1000_lines():
    long = {m: n for m, p in sources().items() if (n := sum(1 for _ in open(p))) > 1000}
    assert not long, f'split these along the seam a reader sees: {long}'


def test_no_module_here_shadows_an_installed_package():
    """A file here named like an installed package hides that package from every import run in
    this folder: a kernels.py would hide Hugging Face's `kernels`, which transformers >= 5 imports,
    and `from transformers import LlamaForCausalLM` would fail here (hence cuda_kernels.py)."""
    mine = {f[:-3] for f in os.listdir(HERE) if f.endswith('.py')}
    mine |= {d for d in os.listdir(HERE) if os.path.isfile(os.path.join(HERE, d, '__init__.py'))}
    installed = importlib.metadata.packages_distributions()  # top-level import name -> distributions
    clashes = {name: installed[name] for name in sorted(mine & set(installed))}
    assert not clashes, f'modules here shadow installed packages (name: distributions): {clashes}'
