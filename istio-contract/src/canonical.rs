//! How Istio names a pod's workload and canonical service: what its telemetry (the `*_workload`,
//! `*_canonical_service` and `*_canonical_revision` labels of `istio_tcp_*`) shows for the pod. istiod derives them
//! from the Pod object and sends them to ztunnel; a node proxy watching pods itself derives the same.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// Pod label that sets the workload name outright.
pub const WORKLOAD_NAME_LABEL: &str = "service.istio.io/workload-name";
/// Pod label that sets the canonical service outright.
pub const CANONICAL_NAME_LABEL: &str = "service.istio.io/canonical-name";
/// Pod label that sets the canonical revision outright.
pub const CANONICAL_REVISION_LABEL: &str = "service.istio.io/canonical-revision";
/// The labels a canonical service is read from, first found wins; without any, it is the workload name.
pub const CANONICAL_NAME_LABELS: [&str; 3] = [CANONICAL_NAME_LABEL, "app.kubernetes.io/name", "app"];
/// The labels a canonical revision is read from, first found wins; without any, it is
/// [`DEFAULT_CANONICAL_REVISION`].
pub const CANONICAL_REVISION_LABELS: [&str; 3] = [CANONICAL_REVISION_LABEL, "app.kubernetes.io/version", "version"];
/// The canonical revision of a pod with none of [`CANONICAL_REVISION_LABELS`].
pub const DEFAULT_CANONICAL_REVISION: &str = "latest";
/// The label a Deployment's ReplicaSet puts on its pods, and suffixes its own name with.
pub const POD_TEMPLATE_HASH_LABEL: &str = "pod-template-hash";
/// The same for an Argo Rollout's ReplicaSet.
pub const ROLLOUTS_POD_TEMPLATE_HASH_LABEL: &str = "rollouts-pod-template-hash";
/// The label OpenShift's DeploymentConfig puts on the pods of its ReplicationController, naming itself.
pub const DEPLOYMENT_CONFIG_LABEL: &str = "deploymentconfig";

/// The workload a pod belongs to, as Istio names it: [`WORKLOAD_NAME_LABEL`] if set; else, for a pod with a
/// generated name, its controller's name, with the pod-template hash of a Deployment's (or Rollout's) ReplicaSet
/// removed, the DeploymentConfig of an OpenShift ReplicationController, and the CronJob of a Job named
/// `<cronjob>-<8 to 10 digits>`; else the pod's own name.
pub fn workload_name(meta: &ObjectMeta) -> String {
    let labels = meta.labels.clone().unwrap_or_default();
    if let Some(name) = labels.get(WORKLOAD_NAME_LABEL) {
        return name.clone();
    }
    let pod_name = meta.name.clone().unwrap_or_default();
    if meta.generate_name.as_deref().unwrap_or_default().is_empty() {
        return pod_name;
    }
    let owners = meta.owner_references.as_deref().unwrap_or_default();
    let Some(controller) = owners.iter().find(|o| o.controller == Some(true)) else {
        return pod_name;
    };
    let label = |key: &str| labels.get(key).map(String::as_str).filter(|v| !v.is_empty());
    let without_hash = |key: &str| {
        let hash = label(key)?;
        controller.name.strip_suffix(hash)?.strip_suffix('-').map(str::to_owned)
    };
    let name = match controller.kind.as_str() {
        "ReplicaSet" => without_hash(POD_TEMPLATE_HASH_LABEL)
            .or_else(|| without_hash(ROLLOUTS_POD_TEMPLATE_HASH_LABEL))
            .unwrap_or_else(|| controller.name.clone()),
        "ReplicationController" => {
            label(DEPLOYMENT_CONFIG_LABEL).map_or_else(|| controller.name.clone(), str::to_owned)
        }
        "Job" => cron_job_name(&controller.name).unwrap_or(&controller.name).to_owned(),
        _ => controller.name.clone(),
    };
    if name.is_empty() {
        pod_name
    } else {
        name
    }
}

/// The CronJob of a Job it created: the name before a final `-` and 8 to 10 digits (the schedule time).
fn cron_job_name(job: &str) -> Option<&str> {
    let (prefix, stamp) = job.rsplit_once('-')?;
    let stamped = (8..=10).contains(&stamp.len()) && stamp.bytes().all(|b| b.is_ascii_digit());
    (stamped && !prefix.is_empty()).then_some(prefix)
}

/// The pod's canonical service and revision, from its `labels`, falling back to `workload_name` and
/// [`DEFAULT_CANONICAL_REVISION`].
pub fn canonical_service(labels: &BTreeMap<String, String>, workload_name: &str) -> (String, String) {
    let first = |keys: &[&str]| keys.iter().find_map(|k| labels.get(*k)).cloned();
    let name = first(&CANONICAL_NAME_LABELS).unwrap_or_else(|| workload_name.to_owned());
    let revision = first(&CANONICAL_REVISION_LABELS).unwrap_or_else(|| DEFAULT_CANONICAL_REVISION.to_owned());
    (name, revision)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    use super::*;

    fn meta(name: &str, generate: bool, labels: &[(&str, &str)], controller: Option<(&str, &str)>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            generate_name: generate.then(|| "x-".to_owned()),
            labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            owner_references: controller.map(|(kind, name)| {
                vec![OwnerReference {
                    kind: kind.into(),
                    name: name.into(),
                    controller: Some(true),
                    ..OwnerReference::default()
                }]
            }),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn workload_names_follow_the_controller() {
        let hash = [(POD_TEMPLATE_HASH_LABEL, "7d4b9c")];
        let deployment = meta("web-7d4b9c-x2x9z", true, &hash, Some(("ReplicaSet", "web-7d4b9c")));
        assert_eq!(workload_name(&deployment), "web");
        let bare_set = meta("web-abcde", true, &[], Some(("ReplicaSet", "web")));
        assert_eq!(workload_name(&bare_set), "web", "a ReplicaSet of its own");
        let cron = meta("report-28990000-abc", true, &[], Some(("Job", "report-28990000")));
        assert_eq!(workload_name(&cron), "report", "a CronJob's Job");
        let job = meta("once-abc", true, &[], Some(("Job", "once-123")));
        assert_eq!(workload_name(&job), "once-123", "a plain Job");
        let dc = [(DEPLOYMENT_CONFIG_LABEL, "legacy")];
        let openshift = meta("legacy-1-abc", true, &dc, Some(("ReplicationController", "legacy-1")));
        assert_eq!(workload_name(&openshift), "legacy");
        let stateful = meta("db-0", true, &[], Some(("StatefulSet", "db")));
        assert_eq!(workload_name(&stateful), "db");
        assert_eq!(workload_name(&meta("solo", false, &[], None)), "solo", "a pod of its own");
        assert_eq!(workload_name(&meta("named-abc", false, &[], Some(("ReplicaSet", "x")))), "named-abc");
        let overridden = meta("web-1", true, &[(WORKLOAD_NAME_LABEL, "front")], Some(("ReplicaSet", "web")));
        assert_eq!(workload_name(&overridden), "front");
    }

    #[test]
    fn canonical_service_reads_labels_in_istios_order() {
        let labels = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert_eq!(canonical_service(&labels(&[]), "web"), ("web".into(), "latest".into()));
        let app = labels(&[("app", "shop"), ("version", "v2")]);
        assert_eq!(canonical_service(&app, "web"), ("shop".into(), "v2".into()));
        let all = labels(&[
            ("app", "shop"),
            ("app.kubernetes.io/name", "store"),
            (CANONICAL_NAME_LABEL, "canon"),
            ("version", "v2"),
            ("app.kubernetes.io/version", "v3"),
        ]);
        assert_eq!(canonical_service(&all, "web"), ("canon".into(), "v3".into()));
    }
}
