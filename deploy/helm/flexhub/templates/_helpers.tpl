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
