#!/usr/bin/env bash
# Refresh the web UI's vendored libraries (http/vendor/) from the npm registry.
#
#   scripts/refresh-web-vendor.sh            # the pinned versions below
#   MARKED=18.2.1 scripts/refresh-web-vendor.sh   # another version of one of them
#
# Each package is fetched with `npm pack` into a temporary folder (nothing is installed, no
# package.json is touched); its browser build and its license are copied into http/vendor/.
# The only change made to the files is dropping the `//# sourceMappingURL=` line (the maps
# are not vendored, so a browser's developer tools would ask for a file that is not there).
# The versions fetched are written to http/vendor/VERSIONS; then run tests/http/test_web_ui.py.
set -euo pipefail

MARKED=${MARKED:-18.2.1}
DOMPURIFY=${DOMPURIFY:-3.4.18}
HIGHLIGHT=${HIGHLIGHT:-11.12.0}

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/http/vendor"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

unpack() {  # unpack NAME VERSION DIR: npm pack NAME@VERSION, untar it into $tmp/DIR
    local tgz
    tgz=$(cd "$tmp" && npm pack --silent "$1@$2" | tail -n 1)
    mkdir -p "$tmp/$3"
    tar -xzf "$tmp/$tgz" -C "$tmp/$3" --strip-components=1
}

copy() {  # copy SRC DEST: without the source-map comment
    sed '/^\/\/# sourceMappingURL=/d' "$1" > "$2"
}

unpack marked "$MARKED" marked
unpack dompurify "$DOMPURIFY" dompurify
unpack @highlightjs/cdn-assets "$HIGHLIGHT" hljs

mkdir -p "$dest"
copy "$tmp/marked/lib/marked.umd.js" "$dest/marked.umd.js"
cp "$tmp/marked/LICENSE" "$dest/LICENSE.marked"
copy "$tmp/dompurify/dist/purify.min.js" "$dest/purify.min.js"
cp "$tmp/dompurify/LICENSE" "$dest/LICENSE.dompurify"
# highlight.js: the prebuilt "common languages" bundle and GitHub's light and dark themes.
copy "$tmp/hljs/highlight.min.js" "$dest/highlight.min.js"
cp "$tmp/hljs/styles/github.min.css" "$dest/hljs-light.min.css"
cp "$tmp/hljs/styles/github-dark.min.css" "$dest/hljs-dark.min.css"
cp "$tmp/hljs/LICENSE" "$dest/LICENSE.highlight.js"

cat > "$dest/VERSIONS" <<VERSIONS
marked $MARKED
dompurify $DOMPURIFY
@highlightjs/cdn-assets $HIGHLIGHT
VERSIONS
echo "http/vendor: marked $MARKED, dompurify $DOMPURIFY, highlight.js $HIGHLIGHT"
