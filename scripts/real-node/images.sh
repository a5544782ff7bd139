#!/usr/bin/env bash
# Builds the real node's container images with podman, without any registry, and writes each as a docker-archive
# tar that `ctr -n k8s.io images import` loads into the node's containerd (1.6):
#
#   localhost/pause:3.10                     pause-3.10.tar   the sandbox image: our own pause (pause.c, static),
#                                                             FROM scratch, ENTRYPOINT ["/pause"]
#   localhost/mesh-app:dev                   mesh-app-dev.tar the test pods' app: Debian's static busybox and its
#                                                             applet links in /bin (PATH=/bin), FROM scratch
#   localhost/install-cni:dev-distroless     install-cni.tar  our image (scripts/build-image.sh), tagged exactly as
#   localhost/install-cni:dev                                 `helm template charts/istio-cni --set global.hub=localhost
#                                                             --set global.tag=dev --set profile=ambient` renders it
#                                                             (profile ambient appends -distroless), and also as :dev
#
#   scripts/real-node/images.sh [DIR]     DIR defaults to /var/cache/istio-cni-rs/real-node/images
#   PODMAN     the podman command, word-split (as scripts/build-image.sh takes it)
#
# Idempotent and quick when nothing changed: pause and mesh-app are rebuilt only when the hash of their inputs
# (sources, busybox binary, compiler, Containerfile) differs from the `.inputs` file next to the archive; our image
# is always rebuilt (cargo and podman build are incremental) but saved again only when its image ID changed.
#
# Test pods with localhost/mesh-app:dev (Debian's busybox 1.35 nc: -l listen, -ll with -e persistent server,
# -p PORT, -w SEC connect timeout, -e PROG per connection; no -k, -z, -u or -s):
#   echo server: command: ["nc", "-ll", "-p", "8080", "-e", "cat"]          (one `cat` per connection)
#   client:      command: ["sh", "-c", "echo hello | nc -w 5 10.22.0.7 8080"]   (prints what the server echoed;
#                busybox nc exits when the server closes or, with -w, on connect timeout)
#   web:         command: ["httpd", "-f", "-p", "8080", "-h", "/www"] and `wget -q -O - http://IP:8080/`
#   idle:        command: ["sleep", "infinity"]
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
out=${1:-/var/cache/istio-cni-rs/real-node/images}
mkdir -p "$out"
PODMAN=${PODMAN:-podman}
podman_cmd() { ${PODMAN} "$@"; }
log() { echo "real-node images: $*" >&2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# save IMAGE... ARCHIVE: a docker-archive holding every given reference, written atomically.
save() {
  local archive=${*: -1} refs=("${@:1:$#-1}")
  rm -f "$archive.tmp"
  if [ "${#refs[@]}" -gt 1 ]; then
    podman_cmd save --quiet --multi-image-archive --format docker-archive --output "$archive.tmp" "${refs[@]}"
  else
    podman_cmd save --quiet --format docker-archive --output "$archive.tmp" "${refs[0]}"
  fi
  mv "$archive.tmp" "$archive"
}

# fresh NAME HASH: true when NAME's archive exists and was built from inputs hashing to HASH.
fresh() { [ -s "$out/$1.tar" ] && [ "$(cat "$out/$1.tar.inputs" 2>/dev/null)" = "$2" ]; }

# The pause image.
pause_containerfile='FROM scratch
COPY pause /pause
ENTRYPOINT ["/pause"]
'
pause_hash=$( { sha256sum scripts/real-node/pause.c; gcc --version | head -n1; echo "$pause_containerfile"; } |
  sha256sum | cut -d' ' -f1)
if fresh pause-3.10 "$pause_hash"; then
  log "localhost/pause:3.10 up to date in $out/pause-3.10.tar"
else
  mkdir "$work/pause"
  gcc -static -O2 -s -Wall -Wextra -Werror -o "$work/pause/pause" scripts/real-node/pause.c
  printf '%s' "$pause_containerfile" >"$work/pause/Containerfile"
  podman_cmd build --quiet --file "$work/pause/Containerfile" --tag localhost/pause:3.10 "$work/pause" >/dev/null
  save localhost/pause:3.10 "$out/pause-3.10.tar"
  echo "$pause_hash" >"$out/pause-3.10.tar.inputs"
  log "built localhost/pause:3.10 into $out/pause-3.10.tar"
fi

# The app image: Debian's busybox-static with every applet linked in /bin.
busybox=/bin/busybox
[ -x "$busybox" ] || { log "$busybox missing: install busybox-static (scripts/install-deps.sh)"; exit 1; }
app_containerfile='FROM scratch
COPY bin/ /bin/
ENV PATH=/bin
CMD ["sh"]
'
app_hash=$( { sha256sum "$busybox"; echo "$app_containerfile"; } | sha256sum | cut -d' ' -f1)
if fresh mesh-app-dev "$app_hash"; then
  log "localhost/mesh-app:dev up to date in $out/mesh-app-dev.tar"
else
  mkdir -p "$work/app/bin"
  cp "$busybox" "$work/app/bin/busybox"
  for applet in $("$busybox" --list); do
    [ "$applet" = busybox ] || ln -s busybox "$work/app/bin/$applet"
  done
  printf '%s' "$app_containerfile" >"$work/app/Containerfile"
  podman_cmd build --quiet --file "$work/app/Containerfile" --tag localhost/mesh-app:dev "$work/app" >/dev/null
  save localhost/mesh-app:dev "$out/mesh-app-dev.tar"
  echo "$app_hash" >"$out/mesh-app-dev.tar.inputs"
  log "built localhost/mesh-app:dev into $out/mesh-app-dev.tar"
fi

# Our image, under the reference the chart renders for the real node's install (and :dev).
rendered=$(helm template istio-cni "$repo/charts/istio-cni" -n istio-system --set global.hub=localhost \
  --set global.tag=dev --set profile=ambient | sed -n 's/^ *image: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' | sort -u)
if [ "$(wc -l <<<"$rendered")" -ne 1 ] || [ -z "$rendered" ]; then
  log "expected one image reference from helm template, got: $rendered"
  exit 1
fi
scripts/build-image.sh localhost/install-cni:dev >&2
podman_cmd tag localhost/install-cni:dev "$rendered"
id=$(podman_cmd image inspect --format '{{.Id}}' localhost/install-cni:dev)
if fresh install-cni "$id $rendered"; then
  log "$rendered (image $id) up to date in $out/install-cni.tar"
else
  save "$rendered" localhost/install-cni:dev "$out/install-cni.tar"
  echo "$id $rendered" >"$out/install-cni.tar.inputs"
  log "saved $rendered and localhost/install-cni:dev (image $id) into $out/install-cni.tar"
fi
log "archives in $out: pause-3.10.tar (localhost/pause:3.10) mesh-app-dev.tar (localhost/mesh-app:dev)" \
  "install-cni.tar ($rendered, localhost/install-cni:dev)"
