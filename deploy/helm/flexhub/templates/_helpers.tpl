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

{{- /* "true" when the DaemonSet runs the node agent: nodeAgent.enabled when it is a boolean,
otherwise (auto) whether the provisioner is enabled. */ -}}
{{- define "flexhub.nodeAgent" -}}
{{- $on := .Values.nodeAgent.enabled -}}
{{- if not (kindIs "bool" $on) -}}
{{- $on = .Values.provisioner.enabled -}}
{{- end -}}
{{- if $on -}}true{{- end -}}
{{- end -}}

{{- define "flexhub.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
