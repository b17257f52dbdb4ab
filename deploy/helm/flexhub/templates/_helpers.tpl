{{- define "flexhub.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- /* The DaemonSet's selector is immutable: it stays what the first plain manifest had, so
that `kubectl apply` of a newer manifest (or a move to the chart) upgrades in place. */ -}}
{{- define "flexhub.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
{{- end -}}

{{- define "flexhub.labels" -}}
{{ include "flexhub.selectorLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "flexhub.serviceAccountName" -}}
{{- default (include "flexhub.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "flexhub.provisionerName" -}}
{{- printf "%s-provisioner" (include "flexhub.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "flexhub.provisionerServiceAccountName" -}}
{{- default (include "flexhub.provisionerName" .) .Values.provisioner.serviceAccount.name -}}
{{- end -}}

{{- /* The provisioner's pods carry a name of their own: the DaemonSet's selector
(app.kubernetes.io/name: flexhub) must never match them. */ -}}
{{- define "flexhub.provisionerSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-provisioner
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /* "true" when the DaemonSet runs the node agent (and its pods hold a token that may
patch and delete PersistentVolumes): never without FlexVolume mode; nodeAgent.enabled when it
is a boolean, otherwise (auto)
whether some storageClasses entry has parameters.backend loopfile, the only backend whose
storage the nodes reclaim. */ -}}
{{- define "flexhub.nodeAgent" -}}
{{- $on := .Values.nodeAgent.enabled -}}
{{- if not (include "flexhub.flexvolume" .) -}}
{{- $on = false -}}
{{- else if not (kindIs "bool" $on) -}}
{{- if ne (toString $on) "auto" -}}
{{- fail (printf "nodeAgent.enabled must be true, false or auto, not %v" $on) -}}
{{- end -}}
{{- $on = false -}}
{{- range .Values.storageClasses -}}
{{- if eq (toString (index (.parameters | default dict) "backend" | default "")) "loopfile" -}}
{{- $on = true -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $on -}}true{{- end -}}
{{- end -}}

{{- define "flexhub.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- /* "true" in FlexVolume mode (flexvolume.enabled, default true: the DaemonSet installs the
driver, with the provisioner and node agent when they are on). Only a boolean false turns it
off; both modes off is refused. */ -}}
{{- define "flexhub.flexvolume" -}}
{{- $fv := true -}}
{{- if hasKey .Values "flexvolume" -}}{{- if hasKey .Values.flexvolume "enabled" -}}{{- $fv = .Values.flexvolume.enabled -}}{{- end -}}{{- end -}}
{{- if not (kindIs "bool" $fv) -}}
{{- fail (printf "flexvolume.enabled must be true or false, not %q" (toString $fv)) -}}
{{- end -}}
{{- if and (not $fv) (not .Values.csi.enabled) -}}
{{- fail "flexvolume.enabled and csi.enabled are both false: nothing to install (set csi.enabled=true, or flexvolume.enabled=true)" -}}
{{- end -}}
{{- if $fv -}}true{{- end -}}
{{- end -}}

{{- /* The CSI driver's name (flexhub/csi/__init__.py DRIVER_NAME): one for every backend. */ -}}
{{- define "flexhub.csiDriver" -}}flexhub.csi.k8s.io{{- end -}}

{{- define "flexhub.csiControllerName" -}}
{{- printf "%s-csi-controller" (include "flexhub.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "flexhub.csiNodeName" -}}
{{- printf "%s-csi-node" (include "flexhub.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "flexhub.csiImage" -}}
{{- $i := .Values.csi.image -}}
{{- printf "%s:%s" ($i.repository | default .Values.image.repository) ($i.tag | default .Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}

{{- /* The socket kubelet calls the node plugin on, and the directory that holds it. */ -}}
{{- define "flexhub.csiPluginDir" -}}
{{- printf "%s/plugins/%s" (.Values.csi.kubeletDir | trimSuffix "/") (include "flexhub.csiDriver" .) -}}
{{- end -}}
