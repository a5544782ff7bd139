#!/usr/bin/env bash
# Builds the istio-cni container image (see Containerfile): the four binaries statically linked on the host
# (x86_64-unknown-linux-gnu with +crt-static, in target/static), staged into a small build context, then
# `podman build` of a FROM scratch image. No registry is needed.
#
# Usage: scripts/build-image.sh [--release] [--binaries-only] [IMAGE]     IMAGE defaults to localhost/install-cni:<version>
#   --release        optimised binaries (slow on small machines); the default dev profile is static too.
#   --binaries-only  only the static binaries (scripts/test.sh builds them before the suite, so a build failure is
#                    reported on its own and the image tests only stage and `podman build`).
#   PODMAN     the podman command, word-split (tests add --root/--runroot/--storage-driver vfs).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=dev
out=debug
binaries_only=
while [ $# -gt 0 ]; do
  case $1 in
    --release) profile=release out=release ;;
    --binaries-only) binaries_only=1 ;;
    *) break ;;
  esac
  shift
done
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
image=${1:-localhost/install-cni:$version}
target=x86_64-unknown-linux-gnu
target_dir=target/static

# --target keeps RUSTFLAGS off build scripts and proc macros, which cannot be linked statically. No debug info:
# it would more than double the image, and the dev build gets faster.
CARGO_PROFILE_DEV_DEBUG=false RUSTFLAGS="-C target-feature=+crt-static" cargo build --profile "$profile" --target "$target" \
  --target-dir "$target_dir" -p plugin -p installer -p node-agent -p hbone-proxy --bins
[ -z "$binaries_only" ] || exit 0

# Debian 12's iptables for the node agent's iptables mode (Istio's default, global.nativeNftables=false): the two
# multi-call programs (package iptables, GPL-2; separate programs the node agent execs, never linked into ours),
# the names the agent execs as symlinks, exactly the shared libraries `ldd` finds for them and for every xtables
# extension module (the matches and targets iptables loads at run time: REDIRECT, TPROXY, socket, mark, ...), the
# dynamic loader, and the Debian copyright file of each package shipped. Staged as a root tree under $1, laid out
# as on Debian (merged /usr: /lib and /lib64 are links into /usr).
stage_iptables() {
  local root=$1 multiarch=x86_64-linux-gnu
  local xtables=/usr/lib/$multiarch/xtables
  local programs=(/usr/sbin/xtables-nft-multi /usr/sbin/xtables-legacy-multi)
  for f in "${programs[@]}" "$xtables/libxt_REDIRECT.so"; do
    [ -e "$f" ] || { echo "build-image: $f missing: install Debian's iptables (scripts/install-deps.sh)" >&2; exit 1; }
  done
  mkdir -p "$root/usr/sbin" "$root/usr/lib/$multiarch" "$root/usr/lib64" "$root$xtables"
  ln -s usr/lib "$root/lib"
  ln -s usr/lib64 "$root/lib64"
  cp "${programs[@]}" "$root/usr/sbin/"
  cp -a "$xtables/." "$root$xtables/"
  # The names redirect/src/iptables execs (<family>-<flavour>[-save|-restore], plain `iptables --version` for
  # FORCE_IPTABLES_BINARY=iptables), plus the plain names pointing at nft as Debian 12's alternatives do.
  local family tool
  for family in iptables ip6tables; do
    for tool in "" -save -restore; do
      ln -s xtables-nft-multi "$root/usr/sbin/$family-nft$tool"
      ln -s xtables-legacy-multi "$root/usr/sbin/$family-legacy$tool"
      ln -s xtables-nft-multi "$root/usr/sbin/$family$tool"
    done
  done
  # Every library the programs and modules load, closed over by ldd (which resolves the whole tree).
  local libs=() loader="" line lib
  while read -r line; do
    case $line in
      *"=> not found"*) echo "build-image: ldd: $line" >&2; exit 1 ;;
      *"=> /"*) lib=${line#*=> }; libs+=("${lib%% (*}") ;;
      /*ld-linux*) loader=${line%% (*} ;;
    esac
  done < <(ldd "${programs[@]}" "$xtables"/*.so | sed 's/ *(0x[0-9a-f]*)$//' | sort -u)
  [ -n "$loader" ] || { echo "build-image: ldd found no dynamic loader" >&2; exit 1; }
  cp -L "$loader" "$root/usr/lib64/$(basename "$loader")"
  for lib in "${libs[@]}"; do
    cp -L "$lib" "$root/usr/lib/$multiarch/$(basename "$lib")"
  done
  # The copyright file of every Debian package a shipped file comes from (GPL-2 for iptables; LGPL for glibc,
  # libmnl, libnftnl, ...): dpkg knows the /usr path of merged-/usr files.
  local pkgs pkg
  pkgs=$(for f in "${programs[@]}" "$xtables/libxt_REDIRECT.so" "$loader" "${libs[@]}"; do
    f=$(realpath "$f")
    dpkg-query -S "$f" 2>/dev/null || dpkg-query -S "${f#/usr}"
  done | cut -d: -f1 | sort -u)
  for pkg in $pkgs; do
    mkdir -p "$root/usr/share/doc/$pkg"
    cp "/usr/share/doc/$pkg/copyright" "$root/usr/share/doc/$pkg/copyright"
  done
}

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
for bin in istio-cni install-cni node-agent hbone-proxy; do
  cp "$target_dir/$target/$out/$bin" "$context/$bin"
done
stage_iptables "$context/iptables"
cp Containerfile "$context/Containerfile"
${PODMAN:-podman} build --quiet --file "$context/Containerfile" --tag "$image" "$context"
echo "build-image: built $image"
