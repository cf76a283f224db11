{{/* Names: <fullname> is the release name, with "-lmcache-p2p" after it unless it already holds
"lmcache-p2p"; at most 40 characters, so that "<fullname>-controller-NN" Services and the
StatefulSet's controller-revision-hash labels stay within 63. */}}
{{- define "lmcache-p2p.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "lmcache-p2p.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "lmcache-p2p.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "lmcache-p2p.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include with (dict "root" . "component" "controller") */}}
{{- define "lmcache-p2p.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lmcache-p2p.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "lmcache-p2p.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The address a process binds: the pod's IP (POD_IP, from the downward API) or, asked for
with listenAddress: all, every interface. The secrets are always on (secrets.yaml). */}}
{{- define "lmcache-p2p.bindHost" -}}
{{- if eq .Values.listenAddress "all" -}}0.0.0.0{{- else if eq .Values.listenAddress "podIP" -}}$(POD_IP){{- else -}}
{{- fail (printf "listenAddress must be podIP or all, not %q" .Values.listenAddress) -}}
{{- end -}}
{{- end -}}

{{- define "lmcache-p2p.podIPEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/* The Secrets holding the mesh secret and the API token: the user's existingSecret or the chart's. */}}
{{- define "lmcache-p2p.meshSecretName" -}}
{{- default (printf "%s-mesh" (include "lmcache-p2p.fullname" .)) .Values.meshSecret.existingSecret -}}
{{- end -}}

{{- define "lmcache-p2p.apiTokenSecretName" -}}
{{- default (printf "%s-api-token" (include "lmcache-p2p.fullname" .)) .Values.apiToken.existingSecret -}}
{{- end -}}

{{/* A secret's value for a Secret the chart renders: the one given in values, else the one the
cluster already holds (an upgrade keeps it), else 43 random characters (~256 bits).
include with (dict "root" . "name" SECRET_NAME "key" KEY "given" VALUE "what" "meshSecret.value") */}}
{{- define "lmcache-p2p.secretValue" -}}
{{- if .given -}}
{{- if lt (len .given) 16 -}}
{{- fail (printf "%s must be at least 16 characters" .what) -}}
{{- end -}}
{{- .given -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if and $existing $existing.data (hasKey $existing.data .key) -}}
{{- index $existing.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 43 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Controller i's Service name, and its address from any namespace (name.namespace.svc). */}}
{{- define "lmcache-p2p.controllerServiceName" -}}
{{- printf "%s-controller-%d" (include "lmcache-p2p.fullname" .root) (int .index) -}}
{{- end -}}

{{- define "lmcache-p2p.controllerHost" -}}
{{- printf "%s.%s.svc" (include "lmcache-p2p.controllerServiceName" .) .root.Release.Namespace -}}
{{- end -}}

{{/* Every controller's "host:port" for one port (pull or reply), comma-separated, in order. */}}
{{- define "lmcache-p2p.controllerList" -}}
{{- $root := .root -}}
{{- $port := .port -}}
{{- $items := list -}}
{{- range $i := until (int $root.Values.controller.replicas) -}}
{{- $items = append $items (printf "%s:%d" (include "lmcache-p2p.controllerHost" (dict "root" $root "index" $i)) (int $port)) -}}
{{- end -}}
{{- join "," $items -}}
{{- end -}}

{{- define "lmcache-p2p.controllerHttpUrls" -}}
{{- $root := . -}}
{{- $items := list -}}
{{- range $i := until (int $root.Values.controller.replicas) -}}
{{- $items = append $items (printf "http://%s:%d" (include "lmcache-p2p.controllerHost" (dict "root" $root "index" $i)) (int $root.Values.controller.ports.http)) -}}
{{- end -}}
{{- join "," $items -}}
{{- end -}}

{{/* One port per TP rank: start + step * rank, comma-separated. */}}
{{- define "lmcache-p2p.rankPorts" -}}
{{- $items := list -}}
{{- range $r := until (int .tp) -}}
{{- $items = append $items (add (int $.start) (mul (int $.step) $r)) -}}
{{- end -}}
{{- join "," $items -}}
{{- end -}}

{{- define "lmcache-p2p.storeUrl" -}}
{{- if .Values.engine.remoteUrl -}}
{{- .Values.engine.remoteUrl -}}
{{- else if .Values.store.enabled -}}
{{- printf "lm://%s-store.%s.svc:%d" (include "lmcache-p2p.fullname" .) .Release.Namespace (int .Values.store.port) -}}
{{- end -}}
{{- end -}}

{{/* The projected volume of the secrets a control-side process reads as files, only those it
needs: include with (dict "root" . "mesh" true "api" true). */}}
{{- define "lmcache-p2p.secretsVolume" -}}
- name: secrets
  projected:
    defaultMode: 288  # 0440: the pod's group (fsGroup) reads, nobody else
    sources:
      {{- if .mesh }}
      - secret:
          name: {{ include "lmcache-p2p.meshSecretName" .root }}
          items:
            - key: {{ .root.Values.meshSecret.key }}
              path: mesh-secret
      {{- end }}
      {{- if .api }}
      - secret:
          name: {{ include "lmcache-p2p.apiTokenSecretName" .root }}
          items:
            - key: {{ .root.Values.apiToken.key }}
              path: api-token
      {{- end }}
{{- end -}}
