{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "rackflow.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name prefix of every object. */}}
{{- define "rackflow.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rackflow.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; call with (dict "root" $ "component" "router"). */}}
{{- define "rackflow.labels" -}}
helm.sh/chart: {{ include "rackflow.chart" .root }}
{{ include "rackflow.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: rackflow
{{- end -}}

{{- define "rackflow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rackflow.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rackflow.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Redis/Valkey host: redis.host, else the in-chart Valkey Service. */}}
{{- define "rackflow.redisHost" -}}
{{- if .Values.redis.host -}}
{{- .Values.redis.host -}}
{{- else if .Values.valkey.enabled -}}
{{- printf "%s-valkey" (include "rackflow.fullname" .) -}}
{{- else -}}
{{- fail "set redis.host or valkey.enabled=true" -}}
{{- end -}}
{{- end -}}

{{/* The Redis URL; $(RACKFLOW_REDIS_PASSWORD) is expanded by Kubernetes from the env entry defined before it.
    redis.cluster: a redis+cluster:// seed URL (Celery then needs RACKFLOW_CELERY_BROKER_URL in extraEnv). */}}
{{- define "rackflow.redisUrl" -}}
{{- $scheme := printf "%s%s" (ternary "rediss" "redis" .Values.redis.tls) (ternary "+cluster" "" .Values.redis.cluster) -}}
{{- $auth := "" -}}
{{- if .Values.redis.existingSecret -}}
{{- $auth = printf "%s:$(RACKFLOW_REDIS_PASSWORD)@" .Values.redis.username -}}
{{- end -}}
{{- $url := printf "%s://%s%s:%v/%v" $scheme $auth (include "rackflow.redisHost" .) .Values.redis.port .Values.redis.db -}}
{{- if .Values.redis.query -}}
{{- $url = printf "%s?%s" $url .Values.redis.query -}}
{{- end -}}
{{- $url -}}
{{- end -}}

{{/* etcd.url, else every member of the in-chart cluster, comma-separated (the client fails over between them). */}}
{{- define "rackflow.etcdUrl" -}}
{{- if .Values.etcd.url -}}
{{- .Values.etcd.url -}}
{{- else if .Values.etcd.enabled -}}
{{- $name := printf "%s-etcd" (include "rackflow.fullname" .) -}}
{{- $urls := list -}}
{{- range $i, $_ := until (int .Values.etcd.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s-headless.%s.svc:2379" $name $i $name $.Release.Namespace) -}}
{{- end -}}
{{- join "," $urls -}}
{{- else -}}
{{- fail "set etcd.url or etcd.enabled=true" -}}
{{- end -}}
{{- end -}}

{{/* Environment of every rackflow container. */}}
{{- define "rackflow.env" -}}
{{- if .Values.redis.existingSecret }}
- name: RACKFLOW_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.passwordKey }}
{{- end }}
- name: RACKFLOW_REDIS_URL
  value: {{ include "rackflow.redisUrl" . | quote }}
- name: RACKFLOW_ETCD_URL
  value: {{ include "rackflow.etcdUrl" . | quote }}
- name: RACKFLOW_LOG_JSON
  value: {{ ternary "1" "0" .Values.logJson | quote }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Engine of the health agent: agent.source, else nvml for GPU engines. */}}
{{- define "rackflow.agentSource" -}}
{{- if .Values.agent.source -}}
{{- .Values.agent.source -}}
{{- else if eq .Values.engine "vllm" -}}
nvml
{{- else -}}
sim
{{- end -}}
{{- end -}}

{{/* The rackflow config file (ConfigMap): .Values.config with cluster.racks from .Values.racks. */}}
{{- define "rackflow.configYaml" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $_ := set $cfg "cluster" (dict "racks" .Values.racks) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Global arguments before the role. */}}
{{- define "rackflow.globalArgs" -}}
- --config
- /etc/rackflow/rackflow.yaml
{{- end -}}

{{/* Pod-level settings shared by rackflow pods. */}}
{{- define "rackflow.podSpecCommon" -}}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* Volumes every rackflow pod mounts: the config and a writable /tmp. */}}
{{- define "rackflow.volumes" -}}
- name: config
  configMap:
    name: {{ include "rackflow.fullname" . }}-config
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "rackflow.volumeMounts" -}}
- name: config
  mountPath: /etc/rackflow
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* Scheduling of a component; call with the component's values. */}}
{{- define "rackflow.scheduling" -}}
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

{{/* Container fields shared by rackflow containers (pull policy, security context, mounts); call with the root
    context. `env` is written by each template: rackflow.env plus its own entries. */}}
{{- define "rackflow.containerCommon" -}}
imagePullPolicy: {{ .Values.image.pullPolicy }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
volumeMounts:
  {{- include "rackflow.volumeMounts" . | nindent 2 }}
{{- end -}}

{{/* The metrics container port. */}}
{{- define "rackflow.metricsPort" -}}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
{{- end -}}
