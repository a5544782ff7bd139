{{/*
The effective cni settings: a value you set wins; an empty one (""/null/{}) takes the platform profile's
(files/profile-platform-<global.platform>.yaml), else the built-in default. Use as
`include "istio-cni.cni" . | fromYaml`.
*/}}
{{- define "istio-cni.cni" -}}
{{- $platform := .Values.global.platform | default "" -}}
{{- $profile := dict -}}
{{- if $platform -}}
{{- $file := .Files.Get (printf "files/profile-platform-%s.yaml" $platform) -}}
{{- if not $file -}}
{{- fail (printf "global.platform %q is not a known platform (k3s, k3d, microk8s, minikube, openshift, gke)" $platform) -}}
{{- end -}}
{{- $profile = (fromYaml $file).cni | default dict -}}
{{- end -}}
{{- $builtin := dict "cniBinDir" "/opt/cni/bin" "cniConfDir" "/etc/cni/net.d" "cniNetnsDir" "/var/run/netns" "chained" true "cniConfFileName" "" "seLinuxOptions" dict -}}
{{- $out := deepCopy .Values.cni -}}
{{- range $key, $fallback := $builtin -}}
{{- $user := index $.Values.cni $key -}}
{{- if or (kindIs "invalid" $user) (and (kindIs "string" $user) (eq $user "")) (and (kindIs "map" $user) (empty $user)) -}}
{{- if hasKey $profile $key -}}
{{- $_ := set $out $key (index $profile $key) -}}
{{- else -}}
{{- $_ := set $out $key $fallback -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The image holding every binary: "<hub>/<image>:<tag>", or cni.image as is when it contains a "/". */}}
{{- define "istio-cni.image" -}}
{{- if contains "/" .Values.cni.image -}}
{{- .Values.cni.image -}}
{{- else -}}
{{- printf "%s/%s:%s" (.Values.cni.hub | default .Values.global.hub) .Values.cni.image (.Values.cni.tag | default .Values.global.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "istio-cni.labels" -}}
app.kubernetes.io/name: istio-cni
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The security context pieces every container shares: the platform's SELinux type and seccomp profile. */}}
{{- define "istio-cni.platformSecurity" -}}
{{- $cni := include "istio-cni.cni" . | fromYaml -}}
{{- $out := dict -}}
{{- with $cni.seLinuxOptions }}{{ $_ := set $out "seLinuxOptions" . }}{{ end -}}
{{- with .Values.cni.seccompProfile }}{{ $_ := set $out "seccompProfile" . }}{{ end -}}
{{- if $out }}{{ toYaml $out }}{{ end -}}
{{- end -}}

{{/* "true" when the repair controller has something to do (repair in place, label or delete broken pods), else
empty. */}}
{{- define "istio-cni.repairActive" -}}
{{- $r := .Values.cni.repair -}}
{{- if and $r.enabled (or $r.repairPods $r.labelPods $r.deletePods) }}true{{ end -}}
{{- end -}}

{{/* "true" when the repair controller repairs pods in place (repairPods): the node agent then enters pods' network
namespaces and programs rules, so it needs the capabilities and host /proc the ambient agent has; else empty. */}}
{{- define "istio-cni.repairInPlace" -}}
{{- $r := .Values.cni.repair -}}
{{- if and $r.enabled $r.repairPods }}true{{ end -}}
{{- end -}}
