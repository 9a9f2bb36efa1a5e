"""
Tests of the repository's shape, which every source file shares: no two modules import each other
(directly or around a longer circle, counting every import statement, deferred ones and `__main__`
blocks included), no source file over 800 lines (attention.py aside) nor test file over 1,000, no
module named like an installed package.

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


def imports(path, names):
    """The project modules path imports anywhere: top level, inside functions, in its
    `if __name__ == '__main__'` block (a script run as `python -m x` imports as much as any other)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name.split('.')[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split('.')[0])
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


def test_imports_are_counted_everywhere(tmp_path):
    """Deferred imports and `__main__` blocks count: `python -m a` importing b, which imports a, is
    a circle as much as two top-level imports are."""
    (tmp_path / 'a.py').write_text("import os\n\ndef f():\n    from b import g\n\nif __name__ == '__main__':\n    import c\n")
    assert imports(str(tmp_path / 'a.py'), {'a', 'b', 'c'}) == {'b', 'c'}


LONGEST = 800  # a source file past this usually holds two things (DESIGN.md)
LONGEST_TEST = 1000
LONG_AS_ONE = {'attention'}  # the FP4 attention: its reference and its Triton kernels read as one


def test_no_python_file_over_its_limit():
    long = {}
    for m, p in sources().items():
        n = sum(1 for _ in open(p))
        limit = LONGEST_TEST if m.startswith('test_') or m == 'conftest' or m in LONG_AS_ONE else LONGEST
        if n > limit:
            long[m] = (n, limit)
    assert not long, f'split these along the seam a reader sees (lines, limit): {long}'


def test_no_module_here_shadows_an_installed_package():
    """A file here named like an installed package hides that package from every import run in
    this folder: a kernels.py would hide Hugging Face's `kernels`, which transformers >= 5 imports,
    and `from transformers import LlamaForCausalLM` would fail here (hence cuda_kernels.py)."""
    mine = {f[:-3] for f in os.listdir(HERE) if f.endswith('.py')}
    mine |= {d for d in os.listdir(HERE) if os.path.isfile(os.path.join(HERE, d, '__init__.py'))}
    installed = importlib.metadata.packages_distributions()  # top-level import name -> distributions
    clashes = {name: installed[name] for name in sorted(mine & set(installed))}
    assert not clashes, f'modules here shadow installed packages (name: distributions): {clashes}'
