/* The pod sandbox's pause process for the real-node tests' localhost/pause:3.10 image (scripts/real-node/images.sh),
 * written here so that no registry is needed. As Kubernetes' own pause: it holds the pod's namespaces and waits;
 * SIGINT or SIGTERM ends it with status 0; as PID 1 of a shared PID namespace it reaps orphaned children on SIGCHLD.
 * Built with `gcc -static -O2`, it runs in a FROM scratch image. */
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
  static const char msg[] = "pause: shutting down on signal\n";
  (void)sig;
  (void)!write(STDERR_FILENO, msg, sizeof msg - 1);
  _exit(0);
}

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    static const char version[] = "pause 3.10 (istio-cni-rs real-node tests)\n";
    return write(STDOUT_FILENO, version, sizeof version - 1) < 0;
  }
  struct sigaction on_stop = {.sa_handler = stop}, on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &on_stop, NULL) < 0 || sigaction(SIGTERM, &on_stop, NULL) < 0 ||
      sigaction(SIGCHLD, &on_child, NULL) < 0)
    return 1;
  for (;;)
    pause();
}
