{{/*
Names. The release's resources are named after the release ("<release>-targetlease", or the
release name alone when it already contains the chart name), cut at 63 characters.
*/}}
{{- define "targetlease.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "targetlease.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "targetlease.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every resource carries. */}}
{{- define "targetlease.labels" -}}
helm.sh/chart: {{ include "targetlease.chart" . }}
{{ include "targetlease.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: targetlease
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels that select the controller's pods; never change them in an upgrade. */}}
{{- define "targetlease.selectorLabels" -}}
app.kubernetes.io/name: {{ include "targetlease.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end }}

{{- define "targetlease.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "targetlease.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The coordination.k8s.io Lease the replicas compete for (in the release namespace). */}}
{{- define "targetlease.leaderElectionName" -}}
{{- printf "%s-controller" (include "targetlease.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "targetlease.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The Secret holding the Valkey URL: the user's, or the one this chart makes from valkey.url. */}}
{{- define "targetlease.valkeySecretName" -}}
{{- if .Values.valkey.existingSecret.name }}
{{- .Values.valkey.existingSecret.name }}
{{- else }}
{{- printf "%s-valkey" (include "targetlease.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Whether the chart makes the Valkey Secret itself. */}}
{{- define "targetlease.createValkeySecret" -}}
{{- /* Not in cluster or Sentinel mode: the seeds or the sentinels are passed instead of a URL,
so a URL Secret would be unused. */}}
{{- if and (eq .Values.controller.backend "valkey") (not .Values.valkey.existingSecret.name) (not .Values.valkey.clusterSeeds) (not .Values.valkey.sentinel.addresses) }}true{{ end }}
{{- end }}

{{/* Where the etcd TLS Secret is mounted. */}}
{{- define "targetlease.etcdTlsDir" -}}/etc/targetlease/etcd-tls{{- end }}

{{/* Where the Valkey TLS Secret is mounted. */}}
{{- define "targetlease.valkeyTlsDir" -}}/etc/targetlease/valkey-tls{{- end }}

{{/* Checks that no combination of values would render a broken controller. */}}
{{- define "targetlease.validate" -}}
{{- if and (eq .Values.controller.backend "memory") (gt (int .Values.replicaCount) 1) }}
{{- fail "controller.backend=memory keeps leases in one process: set replicaCount to 1 (or use Valkey)" }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.controller.leaderElection.enabled) }}
{{- fail "replicaCount > 1 needs controller.leaderElection.enabled=true: two controllers without an elected leader would both renew and release the same leases" }}
{{- end }}
{{- if and .Values.valkey.tls.enabled (not .Values.valkey.tls.secretName) }}
{{- fail "valkey.tls.enabled needs valkey.tls.secretName (a Secret with the CA, and the client certificate and key for mutual TLS)" }}
{{- end }}
{{- if ne (empty .Values.valkey.tls.certKey) (empty .Values.valkey.tls.keyKey) }}
{{- fail "valkey.tls.certKey and valkey.tls.keyKey go together (mutual TLS needs both)" }}
{{- end }}
{{- if and .Values.valkey.tls.serverName (not .Values.valkey.tls.enabled) }}
{{- fail "valkey.tls.serverName needs valkey.tls.enabled (the name is what the servers' TLS certificates are checked against)" }}
{{- end }}
{{- if and .Values.valkey.tls.serverName .Values.valkey.clusterSeeds }}
{{- fail "valkey.tls.serverName cannot be used with valkey.clusterSeeds: every cluster node is checked against the address it announces" }}
{{- end }}
{{- with .Values.valkey.sentinel }}
{{- if and .addresses $.Values.valkey.clusterSeeds }}
{{- fail "valkey.sentinel.addresses and valkey.clusterSeeds exclude each other: Valkey is either a primary behind Sentinel or a Valkey Cluster; empty one of them" }}
{{- end }}
{{- if and .addresses (not .masterName) }}
{{- fail "valkey.sentinel.addresses needs valkey.sentinel.masterName, the name of the primary the sentinels monitor (myprimary in Bitnami's valkey chart, mymaster in valkey-io's)" }}
{{- end }}
{{- if and (not .addresses) (or .masterName .username .existingSecret.name .existingSecret.passwordKey) }}
{{- fail "valkey.sentinel.masterName, username and existingSecret need valkey.sentinel.addresses (the sentinels to ask for the primary); without addresses they would be ignored" }}
{{- end }}
{{- if ne (empty .existingSecret.name) (empty .existingSecret.passwordKey) }}
{{- fail "valkey.sentinel.existingSecret.name and valkey.sentinel.existingSecret.passwordKey go together (the Secret and the key of the sentinels' password in it)" }}
{{- end }}
{{- end }}
{{- with .Values.controller.watchNamespace }}
{{- $watched := splitList "," . }}
{{- range $.Values.controller.holderPods.namespaces }}
{{- if not (has . $watched) }}
{{- fail (printf "controller.holderPods.namespaces lists %s, but the controller watches only %s: holder pods elsewhere belong to TargetLeases it never reconciles" . $.Values.controller.watchNamespace) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq .Values.controller.backend "valkey") (not .Values.valkey.existingSecret.name) (not .Values.valkey.url) (not .Values.valkey.clusterSeeds) (not .Values.valkey.sentinel.addresses) }}
{{- fail "controller.backend=valkey needs valkey.url or valkey.existingSecret.name (or valkey.clusterSeeds, or valkey.sentinel.addresses)" }}
{{- end }}
{{- /* The etcd block may be absent (helm upgrade --reuse-values from a release before it). */}}
{{- $etcd := .Values.etcd | default dict }}
{{- $etcdTls := dig "tls" dict $etcd }}
{{- $etcdSecret := dig "existingSecret" dict $etcd }}
{{- $endpoints := dig "endpoints" list $etcd }}
{{- if and (eq .Values.controller.backend "etcd") (not $endpoints) }}
{{- fail "controller.backend=etcd needs etcd.endpoints, the client URLs of the etcd members" }}
{{- end }}
{{- if and $endpoints (ne .Values.controller.backend "etcd") }}
{{- fail (printf "etcd.endpoints is set but controller.backend is %s: set controller.backend=etcd, or empty etcd.endpoints" .Values.controller.backend) }}
{{- end }}
{{- if and (dig "enabled" false $etcdTls) (not (dig "secretName" "" $etcdTls)) }}
{{- fail "etcd.tls.enabled needs etcd.tls.secretName (a Secret with the CA, and the client certificate and key for mutual TLS)" }}
{{- end }}
{{- if ne (empty (dig "certKey" "" $etcdTls)) (empty (dig "keyKey" "" $etcdTls)) }}
{{- fail "etcd.tls.certKey and etcd.tls.keyKey go together (mutual TLS needs both)" }}
{{- end }}
{{- range $endpoints }}
{{- if and (hasPrefix "https://" .) (not (dig "enabled" false $etcdTls)) }}
{{- fail (printf "etcd endpoint %s is https:// but etcd.tls.enabled is false: the controller needs the CA of the members (etcd.tls.secretName, etcd.tls.caKey)" .) }}
{{- end }}
{{- end }}
{{- if ne (empty (dig "username" "" $etcd)) (empty (dig "name" "" $etcdSecret)) }}
{{- fail "etcd.username and etcd.existingSecret.name go together (the user and the Secret holding its password)" }}
{{- end }}
{{- if ne (empty (dig "name" "" $etcdSecret)) (empty (dig "passwordKey" "" $etcdSecret)) }}
{{- fail "etcd.existingSecret.name and etcd.existingSecret.passwordKey go together (the Secret and the key of the password in it)" }}
{{- end }}
{{- end }}

{{/* Labels of the `helm test` objects: the release's, with another component, so that no
selector of the controller's pods (Service, PodDisruptionBudget, NetworkPolicy) matches them. */}}
{{- define "targetlease.testLabels" -}}
helm.sh/chart: {{ include "targetlease.chart" . }}
app.kubernetes.io/name: {{ include "targetlease.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: helm-test
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: targetlease
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Fails, saying what to do, when a block of values lacks a key it cannot render without: what
`helm upgrade --reuse-values` from a release without that block gives (Helm then applies the
older chart's defaults, not this one's), which would render a test or an alert with empty
settings. Only keys whose absence breaks the output are listed; tests/packaging/chart.rs renders every
other key of the block absent. A key added in a later release must not be listed (a
`--reuse-values` upgrade from this one would leave it unset): give it a default in the template.
Call: include "targetlease.requireKeys" (list .Values.helmTest "helmTest" (list "ttlSeconds")). */}}
{{- define "targetlease.requireKeys" -}}
{{- $values := index . 0 }}
{{- $block := index . 1 }}
{{- $missing := list }}
{{- range (index . 2) }}
{{- if not (hasKey $values .) }}
{{- $missing = append $missing (printf "%s.%s" $block .) }}
{{- end }}
{{- end }}
{{- if $missing }}
{{- fail (printf "%s unset: this chart's defaults were not applied (helm upgrade --reuse-values from an older release keeps that release's defaults); upgrade with --reset-then-reuse-values, or set them" (join ", " $missing)) }}
{{- end }}
{{- end }}

{{/* The PromQL label matchers that pick this release's controllers out of everything Prometheus
scrapes: prometheusRule.selector, else the release namespace and the metrics Service's name (the
job label the Prometheus Operator gives a ServiceMonitor's targets). */}}
{{- define "targetlease.metricsSelector" -}}
{{- if (.Values.prometheusRule | default dict).selector }}
{{- .Values.prometheusRule.selector }}
{{- else }}
{{- printf "namespace=%q,job=%q" .Release.Namespace (printf "%s-metrics" (include "targetlease.fullname" .)) }}
{{- end }}
{{- end }}
