#!/usr/bin/env python3
"""Checks the serving code's shape limits with libclang (Debian: python3-clang-14).

In router/, decode_node/, prefill_node/, worker/ and kvtransfer/:
  - no class has more than 30 member functions (constructors count; defaulted
    and deleted ones do not; overloads count once each);
  - no function is longer than 60 lines (first line to closing brace);
  - no two classes call each other's member functions (no A -> B -> A chain).

  scripts/check_structure.py [--build DIR]   (DIR: a build with compile_commands.json)

Exit status 1 when a limit is passed, with each one named; 2 when it cannot run;
77 (skipped, saying why) without libclang's Python bindings.
"""
import argparse
import collections
import json
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
    for lib in ("/usr/lib/llvm-14/lib/libclang.so.1", "/usr/lib/llvm-14/lib/libclang-14.so.1"):
        if os.path.exists(lib):
            ci.Config.set_library_file(lib)
            break
    return ci


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build", help="build folder holding compile_commands.json")
    args = ap.parse_args()
    root = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
    db_path = os.path.join(args.build, "compile_commands.json")
    if not os.path.exists(db_path):
        print(f"check_structure: {db_path} not found (configure with CMake first)", file=sys.stderr)
        return 2
    ci = load_clang()
    K = ci.CursorKind
    funcs = (K.CXX_METHOD, K.CONSTRUCTOR, K.DESTRUCTOR, K.FUNCTION_TEMPLATE, K.CONVERSION_FUNCTION, K.FUNCTION_DECL)
    classes = (K.CLASS_DECL, K.STRUCT_DECL, K.CLASS_TEMPLATE)

    def ours(path):
        if not path:
            return False
        path = os.path.realpath(path)
        return any(path.startswith(f"{root}/{d}/") for d in FOLDERS)

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

    members = collections.defaultdict(set)
    long_fns = {}
    calls = collections.defaultdict(set)
    index = ci.Index.create()
    build = os.path.realpath(args.build)
    for entry in json.load(open(db_path)):
        src = os.path.realpath(entry["file"])
        in_unity = any(src.startswith(f"{build}/{d}/") for d in FOLDERS)
        if not (ours(src) or in_unity):
            continue
        argv = entry["arguments"][1:] if "arguments" in entry else entry["command"].split()[1:]
        flags, skip = [], False
        for a in argv:
            if skip:
                skip = False
            elif a == "-o":
                skip = True
            elif a != "-c" and os.path.realpath(os.path.join(entry["directory"], a)) != src:
                flags.append(a)
        tu = index.parse(src, args=flags + ["-Wno-everything"])

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
                            for e in c.walk_preorder():
                                ref = e.referenced if e.kind == K.CALL_EXPR else None
                                if ref is None or ref.kind not in (K.CXX_METHOD, K.FUNCTION_TEMPLATE):
                                    continue
                                target = owner(ref)
                                if target is not None and ours(where(ref)) and target.spelling != cls.spelling:
                                    calls[cls.spelling].add(target.spelling)
                if c.kind in classes or c.kind == K.NAMESPACE:
                    visit(c)

        visit(tu.cursor)

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
    biggest = sorted(members.items(), key=lambda kv: -len(kv[1]))[:5]
    print("largest classes: " + ", ".join(f"{c} {len(n)}" for c, n in biggest))
    for f in failures:
        print(f)
    print(f"check_structure: {len(failures)} over the limits" if failures else "check_structure: within the limits")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
