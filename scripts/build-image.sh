#!/usr/bin/env bash
# Builds the istio-cni container image (see Containerfile): the four binaries statically linked on the host
# (x86_64-unknown-linux-gnu with +crt-static, in target/static), staged into a small build context, then
# `podman build` of a FROM scratch image. No registry is needed.
#
# Usage: scripts/build-image.sh [--release] [IMAGE]     IMAGE defaults to localhost/install-cni:<version>
#   --release  optimised binaries (slow on small machines); the default dev profile is static too.
#   PODMAN     the podman command, word-split (tests add --root/--runroot/--storage-driver vfs).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=dev
out=debug
if [ "${1:-}" = "--release" ]; then
  profile=release
  out=release
  shift
fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
image=${1:-localhost/install-cni:$version}
target=x86_64-unknown-linux-gnu
target_dir=target/static

# --target keeps RUSTFLAGS off build scripts and proc macros, which cannot be linked statically. No debug info:
# it would more than double the image, and the dev build gets faster.
CARGO_PROFILE_DEV_DEBUG=false RUSTFLAGS="-C target-feature=+crt-static" cargo build --profile "$profile" --target "$target" \
  --target-dir "$target_dir" -p plugin -p installer -p node-agent -p hbone-proxy --bins

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
for bin in istio-cni install-cni node-agent hbone-proxy; do
  cp "$target_dir/$target/$out/$bin" "$context/$bin"
done
cp Containerfile "$context/Containerfile"
${PODMAN:-podman} build --quiet --file "$context/Containerfile" --tag "$image" "$context"
echo "build-image: built $image"
