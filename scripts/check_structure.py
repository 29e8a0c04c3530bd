#!/usr/bin/env python3
"""Checks the serving code's shape limits with libclang (Debian: python3-clang-14).

In router/, decode_node/, prefill_node/, worker/ and kvtransfer/:
  - no class has more than 30 member functions (constructors count; defaulted
    and deleted ones do not; overloads count once each);
  - no function is longer than 60 lines (first line to closing brace);
  - no two classes call each other's member functions (no A -> B -> A chain),
    a lambda handed to B that calls back into A included.

  scripts/check_structure.py [--build DIR]   (DIR: a build with compile_commands.json)

Exit status 1 when a limit is passed, with each one named; 2 when it cannot run;
77 (skipped, saying why) without libclang's Python bindings.
"""
import argparse
import collections
import json
import multiprocessing
import os
import sys

MAX_MEMBERS = 30
MAX_LINES = 60
FOLDERS = ["router", "decode_node", "prefill_node", "worker", "kvtransfer"]


def load_clang():
    sys.path.append("/usr/lib/python3/dist-packages")
    try:
        import clang.cindex as ci
    except ImportError:
        print("check_structure: skipped: libclang's Python bindings are missing (apt-get install python3-clang-14)")
        sys.exit(77)
    if ci.Config.loaded:
        return ci
    for lib in ("/usr/lib/llvm-14/lib/libclang.so.1", "/usr/lib/llvm-14/lib/libclang-14.so.1"):
        if os.path.exists(lib):
            ci.Config.set_library_file(lib)
            break
    return ci


def scan(job):
    """One translation unit: its classes' member functions, long functions, calls between classes."""
    root, build, entry = job
    ci = load_clang()
    K = ci.CursorKind
    funcs = (K.CXX_METHOD, K.CONSTRUCTOR, K.DESTRUCTOR, K.FUNCTION_TEMPLATE, K.CONVERSION_FUNCTION, K.FUNCTION_DECL)
    methods = (K.CXX_METHOD, K.FUNCTION_TEMPLATE, K.CONSTRUCTOR)
    classes = (K.CLASS_DECL, K.STRUCT_DECL, K.CLASS_TEMPLATE)

    def ours(path):
        return bool(path) and any(os.path.realpath(path).startswith(f"{root}/{d}/") for d in FOLDERS)

    def owner(c):
        p = c.semantic_parent
        while p is not None and p.kind not in classes:
            if p.kind == K.TRANSLATION_UNIT:
                return None
            p = p.semantic_parent
        return p

    def deleted(c):
        if c.is_definition():
            return False
        toks = [t.spelling for t in c.get_tokens()]
        return toks[-2:] == ["=", "delete"] or toks[-3:-1] == ["=", "delete"]

    def where(c):
        return c.location.file.name if c.location.file else None

    def callee(e):
        """(class, member) of ours that `e` calls, or None."""
        ref = e.referenced if e.kind == K.CALL_EXPR else None
        if ref is None or ref.kind not in methods or not ours(where(ref)):
            return None
        target = owner(ref)
        return (target.spelling, ref.spelling) if target is not None else None

    members, long_fns = collections.defaultdict(set), {}
    calls = collections.defaultdict(set)      # class -> classes its members call
    internal = collections.defaultdict(set)   # (class, member) -> its own class's members it calls
    outward = collections.defaultdict(set)    # (class, member) -> other classes it calls
    callbacks = set()                         # (B, A, A's member) a lambda handed to B calls

    def record_calls(fn, cls):
        me = (cls, fn.spelling)
        lambdas = set()
        for e in fn.walk_preorder():
            target = callee(e)
            if target is None:
                continue
            if target[0] == cls:
                internal[me].add(target[1])
                continue
            calls[cls].add(target[0])
            outward[me].add(target[0])
            # A lambda handed to the other class that calls into this one: a callback.
            for lam in e.walk_preorder():
                if lam.kind != K.LAMBDA_EXPR or lam.hash in lambdas:
                    continue
                lambdas.add(lam.hash)
                for inner in lam.walk_preorder():
                    back = callee(inner)
                    if back is not None and back[0] == cls:
                        callbacks.add((target[0], cls, back[1]))

    def visit(cursor):
        for c in cursor.get_children():
            if not ours(where(c)):
                continue
            if c.kind in funcs:
                cls = owner(c)
                if cls is not None and c.kind != K.FUNCTION_DECL:
                    if not c.is_default_method() and not deleted(c):
                        members[cls.spelling].add(c.displayname)
                if c.is_definition():
                    lines = c.extent.end.line - c.extent.start.line + 1
                    name = (cls.spelling + "::" if cls is not None else "") + c.spelling
                    if lines > MAX_LINES:
                        long_fns[(os.path.relpath(where(c), root), c.extent.start.line)] = (name, lines)
                    if cls is not None:
                        record_calls(c, cls.spelling)
            if c.kind in classes or c.kind == K.NAMESPACE:
                visit(c)

    src = os.path.realpath(entry["file"])
    argv = entry["arguments"][1:] if "arguments" in entry else entry["command"].split()[1:]
    flags, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "-o":
            skip = True
        elif a != "-c" and os.path.realpath(os.path.join(entry["directory"], a)) != src:
            flags.append(a)
    visit(ci.Index.create().parse(src, args=flags + ["-Wno-everything"]).cursor)
    return dict(members), long_fns, dict(calls), dict(internal), dict(outward), callbacks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build", help="build folder holding compile_commands.json")
    args = ap.parse_args()
    root = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
    db_path = os.path.join(args.build, "compile_commands.json")
    if not os.path.exists(db_path):
        print(f"check_structure: {db_path} not found (configure with CMake first)", file=sys.stderr)
        return 2
    load_clang()
    build = os.path.realpath(args.build)
    jobs = []
    for entry in json.load(open(db_path)):
        src = os.path.realpath(entry["file"])
        ours = any(src.startswith(f"{root}/{d}/") for d in FOLDERS)
        in_unity = any(src.startswith(f"{build}/{d}/") for d in FOLDERS)  # a unity batch of those folders
        if ours or in_unity:
            jobs.append((root, build, entry))
    members, long_fns = collections.defaultdict(set), {}
    calls, internal, outward = collections.defaultdict(set), collections.defaultdict(set), collections.defaultdict(set)
    callbacks = set()
    with multiprocessing.Pool(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        for m, l, c, i, o, cb in pool.imap_unordered(scan, jobs):
            for k, v in m.items():
                members[k] |= v
            long_fns.update(l)
            for table, part in ((calls, c), (internal, i), (outward, o)):
                for k, v in part.items():
                    table[k] |= v
            callbacks |= cb

    failures = []
    for cls, names in sorted(members.items()):
        if len(names) > MAX_MEMBERS:
            failures.append(f"class {cls}: {len(names)} member functions (limit {MAX_MEMBERS})")
    for (path, line), (name, lines) in sorted(long_fns.items()):
        failures.append(f"{path}:{line}: {name} is {lines} lines (limit {MAX_LINES})")
    for a in sorted(calls):
        for b in sorted(calls[a]):
            if a < b and a in calls.get(b, ()):
                failures.append(f"classes {a} and {b} call each other")
    # A callback closes a chain when what it calls in A goes on to call B: B -> A -> B.
    for b, a, entry in sorted(callbacks):
        seen, todo = set(), [entry]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            todo.extend(internal.get((a, m), ()))
        via = sorted(m for m in seen if b in outward.get((a, m), ()))
        if via:
            failures.append(f"{b} calls back into {a}::{entry} (a lambda), which calls {b} again (through {a}::{via[0]})")
    biggest = sorted(members.items(), key=lambda kv: -len(kv[1]))[:5]
    print("largest classes: " + ", ".join(f"{c} {len(n)}" for c, n in biggest))
    for f in failures:
        print(f)
    print(f"check_structure: {len(failures)} over the limits" if failures else "check_structure: within the limits")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
