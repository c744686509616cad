{{/* Names and labels shared by every object of the release. */}}
{{- define "pdserve.fullname" -}}
{{- printf "%s-pdserve" .Release.Name | trunc 53 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: pdserve
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "pdserve.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default (printf "%s-router" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* Seconds the kubelet waits after the preStop hook starts: preStop + drain + margin. */}}
{{- define "pdserve.grace" -}}
{{- add .root.Values.shutdown.preStopSeconds .drain .root.Values.shutdown.marginSeconds -}}
{{- end -}}

{{/* The model volume, the secret volume and their mounts; the init step. */}}
{{- define "pdserve.modelVolume" -}}
- name: model
  {{- if .Values.model.volume }}
  {{- toYaml .Values.model.volume | nindent 2 }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end -}}

{{- define "pdserve.volumes" -}}
{{ include "pdserve.modelVolume" . }}
- name: secrets
  secret:
    secretName: {{ include "pdserve.secretName" . }}
    defaultMode: 0440
{{- end -}}

{{- define "pdserve.volumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
- name: secrets
  mountPath: {{ .Values.secrets.mountPath }}
  readOnly: true
{{- end -}}

{{- define "pdserve.env" -}}
- name: PDSERVE_CACHE_DIR
  value: {{ .Values.model.mountPath | quote }}
- name: HOME
  value: /tmp
{{- end -}}

{{- define "pdserve.modelInit" -}}
- name: model-init
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: {{ toJson .Values.model.init.command }}
  env:
    {{- include "pdserve.env" . | nindent 4 }}
  volumeMounts:
    {{- include "pdserve.volumeMounts" . | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
{{- end -}}

{{- define "pdserve.initContainers" -}}
{{- if .Values.model.init.enabled }}
initContainers:
  {{- include "pdserve.modelInit" . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pdserve.probes" -}}
startupProbe:
  httpGet: {path: {{ .startup }}, port: http}
  periodSeconds: {{ .root.Values.probes.periodSeconds }}
  timeoutSeconds: {{ .root.Values.probes.timeoutSeconds }}
  failureThreshold: {{ div .root.Values.probes.startupSeconds .root.Values.probes.periodSeconds | max 1 }}
livenessProbe:
  httpGet: {path: {{ .liveness }}, port: http}
  periodSeconds: {{ .root.Values.probes.periodSeconds }}
  timeoutSeconds: {{ .root.Values.probes.timeoutSeconds }}
  failureThreshold: {{ .root.Values.probes.failureThreshold }}
readinessProbe:
  httpGet: {path: {{ .readiness }}, port: http}
  periodSeconds: {{ max 1 (div .root.Values.probes.periodSeconds 2) }}
  timeoutSeconds: {{ .root.Values.probes.timeoutSeconds }}
  failureThreshold: 2
{{- end -}}

{{- define "pdserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
