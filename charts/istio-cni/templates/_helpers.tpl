{{/*
The effective values, layered as Istio's chart layers them (last wins):
  1. the defaults (values.yaml `_internal_defaults_do_not_set`);
  2. the profile: files/profile-<profile>.yaml, then files/profile-compatibility-version-<compatibilityVersion>.yaml,
     then files/profile-platform-<platform>.yaml (`profile`/`platform` at the top level or under `global`); a
     profile's `cni:` section counts as top-level keys;
  3. your values: the top-level keys, then the `cni:` ones (both forms mean the same).
Every template reads them as `$v := include "istio-cni.values" . | fromYaml`.
*/}}
{{- define "istio-cni.values" -}}
{{- $v := deepCopy (index .Values "_internal_defaults_do_not_set" | default dict) -}}
{{- $user := deepCopy (omit .Values "_internal_defaults_do_not_set" "cni") -}}
{{- $userCni := deepCopy (.Values.cni | default dict) -}}
{{- $userGlobal := mustMergeOverwrite (deepCopy ($user.global | default dict)) (deepCopy ($userCni.global | default dict)) -}}
{{- $profile := dict -}}
{{- with coalesce $userCni.profile $user.profile $userGlobal.profile -}}
{{- with $.Files.Get (printf "files/profile-%s.yaml" .) -}}
{{- $profile = fromYaml . -}}
{{- else -}}
{{- fail (printf "unknown profile %q (ambient, demo, preview, remote, stable)" .) -}}
{{- end -}}
{{- end -}}
{{- with coalesce $userCni.compatibilityVersion $user.compatibilityVersion -}}
{{- $version := ternary (printf "%.2f" .) (toString .) (kindIs "float64" .) -}}
{{- with $.Files.Get (printf "files/profile-compatibility-version-%s.yaml" $version) -}}
{{- $profile = mustMergeOverwrite $profile (fromYaml .) -}}
{{- else -}}
{{- fail (printf "unknown compatibilityVersion %q (1.25 to 1.30)" $version) -}}
{{- end -}}
{{- end -}}
{{- with coalesce $userCni.platform $user.platform $userGlobal.platform (($profile.global | default dict).platform) -}}
{{- with $.Files.Get (printf "files/profile-platform-%s.yaml" .) -}}
{{- $profile = mustMergeOverwrite $profile (fromYaml .) -}}
{{- else -}}
{{- fail (printf "unknown platform %q (gke, k3d, k3s, microk8s, minikube, openshift)" .) -}}
{{- end -}}
{{- end -}}
{{- $v = mustMergeOverwrite $v (omit $profile "cni") ($profile.cni | default dict) -}}
{{- $v = mustMergeOverwrite $v $user $userCni -}}
{{- /* Empty host dirs take the defaults (an empty cniBinDir: /home/kubernetes/bin on GKE, as Istio detects it). */ -}}
{{- if not $v.cniBinDir -}}
{{- $_ := set $v "cniBinDir" (ternary "/home/kubernetes/bin" "/opt/cni/bin" (contains "-gke" $.Capabilities.KubeVersion.Version)) -}}
{{- end -}}
{{- if not $v.cniConfDir }}{{ $_ := set $v "cniConfDir" "/etc/cni/net.d" }}{{ end -}}
{{- if not $v.cniNetnsDir }}{{ $_ := set $v "cniNetnsDir" "/var/run/netns" }}{{ end -}}
{{- /* This chart's earlier spellings. */ -}}
{{- with $v.istioOwnedCNIConfigFilename }}{{ if not $v.istioOwnedCNIConfigFileName }}{{ $_ := set $v "istioOwnedCNIConfigFileName" . }}{{ end }}{{ end -}}
{{- if not (kindIs "invalid" $v.rollingMaxUnavailable) -}}
{{- $_ := set $v "updateStrategy" (dict "type" "RollingUpdate" "rollingUpdate" (dict "maxUnavailable" $v.rollingMaxUnavailable)) -}}
{{- end -}}
{{- $_ := set $v.global "tag" ($v.global.tag | default $.Chart.AppVersion) -}}
{{- $_ := set $v "platform" (coalesce $userCni.platform $user.platform $userGlobal.platform (($profile.global | default dict).platform) "") -}}
{{- toYaml $v -}}
{{- end -}}

{{/* The image holding every binary, composed as Istio's chart does: "<hub>/<image>:<tag>[-<variant>]", or image
as is when it contains a "/". The tag defaults to the chart's appVersion. */}}
{{- define "istio-cni.image" -}}
{{- $v := . -}}
{{- if contains "/" $v.image -}}
{{- $v.image -}}
{{- else -}}
{{- $tag := toString ($v.tag | default $v.global.tag) -}}
{{- with ($v.variant | default $v.global.variant) }}{{ $tag = printf "%s-%s" $tag . }}{{ end -}}
{{- printf "%s/%s:%s" ($v.hub | default $v.global.hub) ($v.image | default "install-cni") $tag -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object (with the effective values as `v`, the root as `root`). */}}
{{- define "istio-cni.labels" -}}
app.kubernetes.io/name: istio-cni
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: istio
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
istio.io/rev: {{ .v.revision | default "default" | quote }}
install.operator.istio.io/owning-resource: {{ .v.ownerName | default "unknown" | quote }}
operator.istio.io/component: Cni
{{- end -}}

{{/* The security context pieces every istio-cni-node container shares: SELinux (type spc_t unless the options
name one, as Istio's chart), seccomp, and AppArmor unconfined when not set by annotation. */}}
{{- define "istio-cni.podSecurity" -}}
{{- $out := dict -}}
{{- with .seLinuxOptions }}{{ $_ := set $out "seLinuxOptions" (merge (deepCopy .) (dict "type" "spc_t")) }}{{ end -}}
{{- with .seccompProfile }}{{ $_ := set $out "seccompProfile" . }}{{ end -}}
{{- if not .useAppArmorAnnotation }}{{ $_ := set $out "appArmorProfile" (dict "type" "Unconfined") }}{{ end -}}
{{- if $out }}{{ toYaml $out }}{{ end -}}
{{- end -}}

{{/* "true" when the repair controller has something to do (repair in place, label or delete broken pods). */}}
{{- define "istio-cni.repairActive" -}}
{{- $r := .repair -}}
{{- if and $r.enabled (or $r.repairPods $r.labelPods $r.deletePods) }}true{{ end -}}
{{- end -}}

{{/* "true" when the repair controller repairs pods in place (repairPods): the node agent then enters pods' network
namespaces and programs rules, so it needs the capabilities and host /proc the ambient agent has. */}}
{{- define "istio-cni.repairInPlace" -}}
{{- $r := .repair -}}
{{- if and $r.enabled $r.repairPods }}true{{ end -}}
{{- end -}}

{{/* "true" when namespaced objects are rendered (global.resourceScope all or namespace). */}}
{{- define "istio-cni.namespaced" -}}
{{- if has (.global.resourceScope | default "all") (list "all" "namespace") }}true{{ end -}}
{{- end -}}

{{/* "true" when cluster-scoped objects are rendered (global.resourceScope all or cluster). */}}
{{- define "istio-cni.clusterScoped" -}}
{{- if has (.global.resourceScope | default "all") (list "all" "cluster") }}true{{ end -}}
{{- end -}}
