{{/* Names, labels and the pieces every member's pod shares. */}}

{{- define "shimmer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "shimmer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "shimmer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "shimmer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selects every member of this release (coordinators and workers). */}}
{{- define "shimmer.memberSelector" -}}
app.kubernetes.io/name: {{ include "shimmer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "shimmer.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "shimmer.tokenSecret" -}}
{{- .Values.joinToken.existingSecret | default (printf "%s-join-token" (include "shimmer.fullname" .)) }}
{{- end }}

{{- define "shimmer.apiKeySecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-key" (include "shimmer.fullname" .)) }}
{{- end }}

{{- define "shimmer.apiKeyEnabled" -}}
{{- if or .Values.apiKeys.existingSecret .Values.apiKeys.value }}true{{ end }}
{{- end }}

{{- define "shimmer.metricsKeySecret" -}}
{{- .Values.metricsApiKey.existingSecret | default (printf "%s-metrics-api-key" (include "shimmer.fullname" .)) }}
{{- end }}

{{- define "shimmer.metricsKeyEnabled" -}}
{{- if or .Values.metricsApiKey.existingSecret .Values.metricsApiKey.value }}true{{ end }}
{{- end }}

{{/* The headless Service a StatefulSet's pods are named under: "worker" or "coordinator". */}}
{{- define "shimmer.headless" -}}
{{ include "shimmer.fullname" .root }}-{{ .component }}
{{- end }}

{{- define "shimmer.serviceDomain" -}}
{{ include "shimmer.headless" . }}.{{ .root.Release.Namespace }}.svc.{{ .root.Values.clusterDomain }}
{{- end }}

{{/* Where a member finds the others: every pod of both headless Services. */}}
{{- define "shimmer.joinSeeds" -}}
dns:{{ include "shimmer.serviceDomain" (dict "root" . "component" "worker") }}:7070,dns:{{ include "shimmer.serviceDomain" (dict "root" . "component" "coordinator") }}:7070
{{- end }}

{{/* Arguments every member takes: its data directory, the control plane's shape, how it joins. */}}
{{- define "shimmer.memberArgs" -}}
- --listen
- 0.0.0.0:7070
- --advertise
- $(POD_NAME).{{ include "shimmer.serviceDomain" . }}
- --data-dir
- /data/raft
- --join
- {{ include "shimmer.joinSeeds" .root }}
- --bootstrap-on
- {{ include "shimmer.fullname" .root }}-worker-0.{{ include "shimmer.serviceDomain" (dict "root" .root "component" "worker") }}
- --max-voters
- {{ .root.Values.raft.maxVoters | quote }}
- --replicas
- {{ .root.Values.raft.replicas | quote }}
- --no-mdns
{{- if eq .root.Values.model.source "hf" }}
- --model
- /data/model
{{- end }}
{{- end }}

{{- define "shimmer.memberEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: SHIMMER_JOIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "shimmer.tokenSecret" . }}
      key: token
{{- if include "shimmer.metricsKeyEnabled" . }}
- name: SHIMMER_METRICS_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "shimmer.metricsKeySecret" . }}
      key: metrics-api-key
{{- end }}
{{- end }}

{{/* The init container that converts a Hugging Face checkpoint into the pod's data volume. */}}
{{- define "shimmer.convertInit" -}}
{{- if eq .Values.model.source "hf" }}
initContainers:
  - name: convert
    image: {{ include "shimmer.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    args:
      - convert
      - --from
      - /hf/{{ .Values.model.hf.path }}
      - --to
      - /data/model
      - --quant
      - {{ .Values.model.hf.quant }}
      - --dense-quant
      - {{ .Values.model.hf.denseQuant }}
      - --quiet
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: data
        mountPath: /data
      - name: hf
        mountPath: /hf
        readOnly: true
{{- end }}
{{- end }}

{{- define "shimmer.volumes" -}}
volumes:
  - name: tmp
    emptyDir: {}
{{- if eq .root.Values.model.source "hf" }}
  - name: hf
    {{- toYaml .root.Values.model.hf.volume | nindent 4 }}
{{- end }}
{{- if not .persistence.enabled }}
  - name: data
    emptyDir: {}
{{- end }}
{{- end }}

{{- define "shimmer.volumeClaims" -}}
{{- if .persistence.enabled }}
volumeClaimTemplates:
  - metadata:
      name: data
    spec:
      accessModes: ["ReadWriteOnce"]
      {{- with .persistence.storageClass }}
      storageClassName: {{ . }}
      {{- end }}
      resources:
        requests:
          storage: {{ .persistence.size }}
{{- end }}
{{- end }}

{{/* Spread members over nodes (soft), unless the values say otherwise. */}}
{{- define "shimmer.affinity" -}}
{{- if .affinity }}
{{- toYaml .affinity }}
{{- else }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "shimmer.memberSelector" .root | nindent 12 }}
            app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}
