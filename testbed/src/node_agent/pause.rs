//! The node agent's enrollment pause, from the test side: arms it through the agent's env and waits on and
//! releases its files.

use tempfile::TempDir;

use crate::wait::eventually;

/// The node agent's enrollment pause, a test hook of its debug builds (`node-agent/src/enroll/mod.rs`, module doc):
/// every enrollment reaching the chosen stage announces itself with `<dir>/<pod uid>.paused` and waits for
/// `<dir>/<pod uid>.resume`. For deleting a pod at a precise point of its enrollment.
#[derive(Debug)]
pub struct EnrollmentPause {
    stage: &'static str,
    dir: TempDir,
}

impl EnrollmentPause {
    /// The agent's enrollment stages in order (its `enroll::Stage` names; a node-agent unit test keeps the two
    /// equal): before the in-pod rules, before the proxy's Add, before the host probe entry, before the
    /// annotation, and after it.
    pub const STAGES: [&'static str; 5] = ["rules", "proxy", "probe", "annotate", "enrolled"];
    /// Names the stage to pause at.
    pub const STAGE_ENV: &'static str = "NODE_AGENT_TEST_PAUSE_STAGE";
    /// Names the directory of the pause files.
    pub const DIR_ENV: &'static str = "NODE_AGENT_TEST_PAUSE_DIR";

    /// A pause at `stage` (one of [`EnrollmentPause::STAGES`]), with a fresh directory for its files.
    pub fn at(stage: &'static str) -> Self {
        assert!(Self::STAGES.contains(&stage), "{stage} is none of the agent's enrollment stages {:?}", Self::STAGES);
        let dir = tempfile::Builder::new().prefix("enroll-pause-").tempdir().expect("pause dir");
        Self { stage, dir }
    }

    /// The agent env that arms the pause, for [`NodeAgent::start`]'s overrides.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![(Self::STAGE_ENV, self.stage.to_owned()), (Self::DIR_ENV, self.dir.path().display().to_string())]
    }

    /// Waits until the enrollment of pod `uid` is paused at the stage.
    #[track_caller]
    pub fn wait_paused(&self, uid: &str) {
        let paused = self.dir.path().join(format!("{uid}.paused"));
        eventually(&format!("the enrollment of {uid} pauses at stage {}", self.stage), || {
            paused.exists().then_some(())
        });
    }

    /// Lets the enrollment of pod `uid` go on.
    pub fn resume(&self, uid: &str) {
        std::fs::write(self.dir.path().join(format!("{uid}.resume")), b"").expect("write resume file");
    }
}
